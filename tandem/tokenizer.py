"""The tokenizer the engine uses: a thin wrapper over a `transformers` tokenizer with the ids and calls it needs.

`Tokenizer.from_path` loads, from local files only:
- an HF folder (`tokenizer.json` / `tokenizer_config.json`, via `AutoTokenizer`), plus the extra EOS ids of its
  `generation_config.json`;
- a `.gguf` file (the tokenizer embedded in the GGUF metadata);
- a bare folder `transformers` cannot read on its own: one SentencePiece `*.model` file (llama2.c checkpoints such
  as stories260K) or GPT-2 style `vocab.json` + `merges.txt`;
- a SentencePiece `.model` file.

Decoding never applies `clean_up_tokenization_spaces`: the incremental detokenizer decodes short windows of ids, and
the clean-up rules (" ." -> ".") would give a different text for a window than for the whole output.

Chat prompts go through one seam, the tokenizer's `ChatFormat`: a Jinja chat template (`TemplateChatFormat`, the
default), or, for a folder whose config.json is gpt-oss's and whose vocabulary holds harmony's markers, harmony
(`tandem/tools/harmony.py`: rendered by openai_harmony, its assistant-action stop tokens `<|return|>` / `<|call|>`
added to the EOS ids). A chat template
given explicitly (`chat_template=`, `set_chat_template`) replaces either.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from transformers import AutoTokenizer, GPT2Tokenizer, LlamaTokenizer, PreTrainedTokenizerBase

from tandem.config import SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES, ConfigError

# model families whose chat format is not a template (the format's loader, imported when such a folder is loaded)
HARMONY_FAMILIES = frozenset({"gpt_oss"})


class ChatFormat(Protocol):
    """How a conversation becomes a prompt: `Tokenizer.apply_chat_template` / `render_chat` call it.

    name              "template" | "harmony"
    tool_call_parser  the tool-call format this chat format fixes (None: read off the template's text)
    reasoning_parser  the reasoning parser this chat format implies, used when none is given (harmony's channels:
                      "openai_gptoss"); None: no reasoning parser unless one is asked for
    stop_token_ids    tokens that end an assistant turn besides the tokenizer's EOS (added to its EOS ids)
    call_token_ids    those of them that end a tool call (harmony's `<|call|>`): a grammar forcing a call writes
                      them itself, so the grammar backends take them as grammar tokens, not as EOS
    available         whether it can render at all (a template format without a template cannot)
    """

    name: str
    tool_call_parser: str | None
    reasoning_parser: str | None
    stop_token_ids: tuple[int, ...]
    call_token_ids: tuple[int, ...]

    @property
    def available(self) -> bool: ...

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        """Prompt token ids of `messages` (nothing added by the tokenizer's post-processor)."""
        ...

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        """The same prompt as text."""
        ...


class Tokenizer:
    """Wraps a transformers tokenizer (AutoTokenizer) with what the engine needs."""

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()) -> None:
        """Wrap `hf`; `extra_eos_token_ids` (e.g. from generation_config.json) also end a request."""
        self.hf = hf
        self.vocab_size: int = len(hf)
        eos = ([hf.eos_token_id] if hf.eos_token_id is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(int(e) for e in eos)
        )  # deduplicated, in order
        self.bos_token_id: int | None = hf.bos_token_id
        self._rust_decode = _rust_decoder(hf)
        self.chat_format: ChatFormat = TemplateChatFormat(self)

    # ---- loading -------------------------------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load from a folder, a `.gguf` file or a SentencePiece `.model` file (local files only).

        `chat_template` replaces the tokenizer's own template: Jinja text, or the path of a file holding it.
        Raises ConfigError naming `path` when nothing loadable is there.
        """
        p = Path(path)
        if not p.exists():
            raise ConfigError(
                f"tokenizer path {p} does not exist (expected a folder, a .gguf or a .model file)"
            )
        try:
            if p.is_file() and p.suffix == ".gguf":
                hf = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
                tok = cls(hf)
            elif p.is_file() and p.suffix == ".model":
                tok = cls.from_sentencepiece(p)
            elif p.is_dir():
                tok = cls._from_folder(p)
                tok._use_family_format(p)
            else:
                raise ConfigError(f"tokenizer path {p} is neither a folder, a .gguf file nor a .model file")
        except ConfigError:
            raise
        except Exception as e:
            # transformers raises OSError / ValueError / KeyError / ... for unreadable or unsupported files
            raise ConfigError(f"cannot load a tokenizer from {p}: {type(e).__name__}: {e}") from e
        if chat_template is not None:
            tok.set_chat_template(chat_template)
        return tok

    @classmethod
    def _from_folder(cls, folder: Path) -> Tokenizer:
        """An HF folder via AutoTokenizer; otherwise a bare SentencePiece or GPT-2 BPE folder."""
        extra_eos = _generation_config_eos(folder)
        if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), extra_eos)
        spm_files = sorted(folder.glob("*.model"))
        if len(spm_files) == 1:
            return cls.from_sentencepiece(spm_files[0], extra_eos)
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            return cls(GPT2Tokenizer.from_pretrained(str(folder), local_files_only=True), extra_eos)
        raise ConfigError(
            f"no tokenizer in folder {folder}: expected tokenizer.json / tokenizer_config.json, one SentencePiece "
            "*.model file, or vocab.json + merges.txt"
        )

    @classmethod
    def from_sentencepiece(cls, model_file: str | Path, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build a Llama-style BPE tokenizer (byte fallback, "▁" spaces, BOS added) from a SentencePiece model.

        Reads the pieces with the `sentencepiece` library (no protobuf needed); control pieces (<s>, </s>) become
        special tokens. The model's normalizer is not reproduced: runs of spaces are kept, not collapsed.
        """
        import sentencepiece as spm
        from transformers.convert_slow_tokenizer import generate_merges

        sp = spm.SentencePieceProcessor(model_file=str(model_file))
        vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        merges = generate_merges(vocab)

        def piece(i: int) -> str | None:
            return sp.id_to_piece(i) if i >= 0 else None

        hf = LlamaTokenizer(
            vocab=vocab,
            merges=merges,
            unk_token=piece(sp.unk_id()),
            bos_token=piece(sp.bos_id()),
            eos_token=piece(sp.eos_id()),
            add_bos_token=sp.bos_id() >= 0,
            add_eos_token=False,
        )
        return cls(hf, extra_eos_token_ids)

    def set_chat_template(self, chat_template: str) -> None:
        """Replace the chat template with `chat_template` (Jinja text, or a path to a file holding it); prompts are
        rendered by it from now on, whatever the chat format was."""
        candidate = Path(chat_template) if len(chat_template) < 4096 and "\n" not in chat_template else None
        if candidate is not None and candidate.is_file():
            chat_template = candidate.read_text()
        self.hf.chat_template = chat_template
        self.chat_format = TemplateChatFormat(self)

    def use_chat_format(self, chat_format: ChatFormat) -> None:
        """Render prompts with `chat_format`; its stop tokens join the EOS ids."""
        self.chat_format = chat_format
        self.eos_token_ids = tuple(dict.fromkeys((*self.eos_token_ids, *chat_format.stop_token_ids)))

    def _use_family_format(self, folder: Path) -> None:
        """Harmony for a gpt-oss folder (its config.json's family) whose tokenizer holds harmony's markers at their
        ids; ConfigError when harmony's o200k_base vocabulary file is missing. A gpt-oss config beside another
        tokenizer (tiny test models, the benchmarks' shapes) keeps that tokenizer's template."""
        if model_family(folder) in HARMONY_FAMILIES:
            from tandem.tools.harmony import HarmonyChatFormat, speaks_harmony

            if speaks_harmony(self.hf.get_vocab()):
                self.use_chat_format(HarmonyChatFormat.load(self.hf.get_vocab))

    # ---- text <-> ids --------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds (e.g. BOS)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Text of `ids` (no tokenization-space clean-up; see the module docstring)."""
        if self._rust_decode is not None:
            return str(self._rust_decode(list(ids), skip_special_tokens=skip_special_tokens))
        return str(
            self.hf.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    @property
    def has_chat_template(self) -> bool:
        """Whether chats can be rendered (a template, or a chat format that needs none)."""
        return self.chat_format.available

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """The chat format applied to `messages`, as text; ConfigError when the tokenizer has no template."""
        return self.chat_format.render_text(messages, add_generation_prompt, **kw)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Token ids of the rendered chat (the format writes its own special tokens: none are added here)."""
        return self.chat_format.render(messages, add_generation_prompt, **kw)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special added tokens: the ones `decode(..., skip_special_tokens=True)` drops."""
        return frozenset(int(i) for i, tok in self.hf.added_tokens_decoder.items() if tok.special)

    def token_strings(self) -> list[str]:
        """The raw vocabulary piece of each id in [0, vocab_size) ("Ġthe", "▁the", "<0xE2>"); "" for holes."""
        pieces = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        return [p if isinstance(p, str) else "" for p in pieces]

    def __repr__(self) -> str:
        return f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


class TemplateChatFormat:
    """A Jinja chat template (the tokenizer's own, or one given) rendered by transformers."""

    name = "template"
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    stop_token_ids: tuple[int, ...] = ()
    call_token_ids: tuple[int, ...] = ()

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @property
    def available(self) -> bool:
        return getattr(self._tokenizer.hf, "chat_template", None) is not None

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        """The template applied to `messages`; ConfigError when the tokenizer has none."""
        if not self.available:
            raise ConfigError(
                "this tokenizer has no chat template; pass chat_template=... (Jinja text or a file path) "
                "or send a plain completion prompt"
            )
        hf = self._tokenizer.hf
        return str(hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        """The template's text encoded; it writes its own special tokens, so none are added."""
        return self._tokenizer.encode(self.render_text(messages, add_generation_prompt, **kw), add_special_tokens=False)


def model_family(folder: Path) -> str | None:
    """tandem's family of the model whose config.json is in `folder` (None: no config, or an unknown model)."""
    f = folder / "config.json"
    if not f.is_file():
        return None
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, OSError):
        return None
    if not isinstance(cfg, dict):
        return None
    for arch in cfg.get("architectures") or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    return SUPPORTED_MODEL_TYPES.get(str(cfg.get("model_type", "")))


def _generation_config_eos(folder: Path) -> tuple[int, ...]:
    """The eos_token_id(s) of `folder/generation_config.json` (an int or a list), or () when absent."""
    f = folder / "generation_config.json"
    if not f.is_file():
        return ()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{f} is not a valid JSON object: {e}") from e
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def _rust_decoder(hf: PreTrainedTokenizerBase) -> Any:
    """The `tokenizers` decode a fast tokenizer's `decode` ends in, when it gives the same text: what `hf.decode`
    returns without clean-up (a fast tokenizer ignores `spaces_between_special_tokens`), without its ~7 us of Python
    argument handling per call (the detokenizer decodes twice per token and request: ~3 ms a step at 256 requests).
    Checked here on a probe of ids (the first 256 and the special ones, with and without them); None for other
    tokenizers or a class whose decoding differs (its `decode` is used)."""
    if not getattr(hf, "is_fast", False) or type(hf).decode is not PreTrainedTokenizerBase.decode:
        return None
    backend = hf.backend_tokenizer.decode
    probe = list(range(min(len(hf), 256))) + sorted(int(t) for t in hf.all_special_ids)
    for skip in (True, False):
        if backend(probe, skip_special_tokens=skip) != hf.decode(probe, skip_special_tokens=skip,
                                                                 clean_up_tokenization_spaces=False):
            return None
    return backend
