"""A proposer the tests script (registered by name with `register_proposer`): each request's drafts are a function
of its token ids, to reach a path real drafters reach only by chance."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.spec_decode.proposer import Drafts, Proposer

Script = Callable[[Sequence[int], int], list[int]]  # (a request's token ids, max drafts) -> its drafts


class ScriptedProposer(Proposer):
    """Each request's drafts are `script(its token ids, max drafts)`."""

    def __init__(self, name: str, script: Script) -> None:
        self.name, self._script = name, script

    def propose(self, batch):  # type: ignore[no-untyped-def]
        return {r.request_id: Drafts(self._script(r.token_ids, r.max_drafts)) for r in batch}

    def on_verified(self, request_id, accepted, num_drafted):  # type: ignore[no-untyped-def]
        pass

    def release(self, request_id):  # type: ignore[no-untyped-def]
        pass
