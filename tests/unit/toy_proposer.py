"""A toy speculative algorithm, registered from the tests: proof that adding a proposer is one
package's worth of code plus one registry entry (docs/architecture.md, "Adding a proposer").

REPEAT drafts a chain of the request's last token repeated: accepted wherever the target
repeats itself, rejected elsewhere, and either way the output must equal plain decoding's.
Importing this module registers it; an engine process reaches `make_proposer` by this
module's name, so the server path works as well as the offline one.
"""
from __future__ import annotations

from dataclasses import replace

from specserve.core.config import SpecConfig
from specserve.core.request import Req
from specserve.spec import registry
from specserve.spec.drafts import Drafts
from specserve.spec.proposer import Proposer, Verified

NAME = "REPEAT"


class RepeatLast(Proposer):
    """Drafts budget - 1 copies of the root token below it, as a chain."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.max_nodes = num_draft_tokens
        self.live: set[str] = set()  # requests between add_request and remove_request

    def add_request(self, req: Req) -> None:
        self.live.add(req.rid)

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        return Drafts.chains([r.last_id for r in reqs], [[r.last_id] * (n - 1) for r, n in zip(reqs, budgets)])

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        pass

    def remove_request(self, req: Req) -> None:
        self.live.discard(req.rid)


def make_proposer(spec: SpecConfig, runner, kv, max_running: int) -> RepeatLast:
    return RepeatLast(spec.num_draft_tokens)


def defaults(spec: SpecConfig, architecture: str | None) -> SpecConfig:
    """A chain of 3 drafts unless --speculative-num-draft-tokens says otherwise."""
    n = spec.num_draft_tokens or 4
    return replace(spec, num_steps=n - 1, eagle_topk=1, num_draft_tokens=n)


TOY = registry.register(registry.Algorithm(
    name=NAME, make_proposer=make_proposer, summary="the last token repeated (a test's toy)",
    draft_model="none", tree_flags=False, defaults=defaults))
