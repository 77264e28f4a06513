"""Incremental detokenization: output token ids -> text deltas that only ever hold complete characters.

The method is vLLM's `detokenize_incrementally` (prefix_offset / read_offset), applied to id windows:

    ids:   ... | prefix_offset ........ read_offset ........ end |
                 `-- already emitted --'`--- not yet emitted ---'

`prefix_text = decode(ids[prefix:read])` and `new_text = decode(ids[prefix:])`; the delta is
`new_text[len(prefix_text):]`. Decoding from `prefix_offset` instead of `read_offset` gives the decoder the context
it needs for the first new token: SentencePiece decoders strip the leading "▁" of the first token of a decode
(so "▁time" alone is "time", but after "▁a" it is " time"), and WordPiece "##" pieces glue to what precedes them.
The window starts in the last few prompt tokens, so the first output token reads like a continuation of the prompt.

When `new_text` ends in U+FFFD the last token(s) end inside a UTF-8 sequence (a byte-level BPE piece holding the
first bytes of an emoji, or SentencePiece <0xF0> byte-fallback tokens): nothing is emitted and both offsets stay, so
the next call decodes the same window plus the new tokens, until the character completes. Once a delta is emitted,
`prefix_offset` moves to the old `read_offset` and `read_offset` to the end: each call decodes only the ids since the
last emitted delta plus one emitted batch of context, so its cost does not grow with the output length.

A dangling incomplete UTF-8 sequence at the very end of the output is never emitted (as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.params import SamplingParams
from tandem.tokenizer import Tokenizer

# prompt tokens decoded as context before the first output token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, emitting only complete characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._spaces_between_special_tokens = params.spaces_between_special_tokens
        self._skipped_ids = tokenizer.special_token_ids if params.skip_special_tokens else frozenset()
        # invariant: self._ids[:self._read_offset] has been emitted (its prompt part counts as emitted context);
        # self._ids[self._prefix_offset:self._read_offset] decodes to self._prefix_text and starts on a character
        # boundary (or in the prompt); self._prefix_offset <= self._read_offset <= len(self._ids)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self.text = ""
        self.num_tokens = 0  # output tokens added so far

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append output `token_ids`; return the newly completed text (may be "") and extend `self.text` by it."""
        self.num_tokens += len(token_ids)
        if self._skipped_ids:
            # dropped here exactly as decode would drop them, so a run of skipped tokens (EOS repeated under
            # ignore_eos) does not widen the decode window
            token_ids = [t for t in token_ids if t not in self._skipped_ids]
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new, or the last character is still incomplete: wait for more bytes
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._trim_window()
        self.text += delta
        return delta

    def add_tokens_at_once(self, token_ids: Sequence[int]) -> str:
        """`add_tokens` for many ids in one decode (the deferred text of a request that reports only its final
        output). The same text as one call per id for byte-level BPE, and for SentencePiece wherever the output
        decodes cleanly (its decode of stray byte-fallback or special ids depends on the window); if the text ends
        inside a character, the calls per id are made, which emit the characters completed before it."""
        before = len(self._ids)
        delta = self.add_tokens(token_ids)
        if delta or not token_ids:
            return delta
        del self._ids[before:]  # nothing emitted: the state is as before but for the ids appended
        self.num_tokens -= len(token_ids)
        return "".join([self.add_tokens([t]) for t in token_ids])

    def _trim_window(self) -> None:
        """Drop ids before prefix_offset (never decoded again), so `_ids` holds only the live window."""
        if self._prefix_offset:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
        )
