"""`Engine.explain`: what a request for a prompt would do, before it runs, as the plan a request would make and rows
a person reads.

The plan is made as a request makes it (request.prompt_segments, `Planner.plan`), from answers that read nothing
(`Store.where`, lookups.WhereLookups): no forward pass runs and the store is left as it is (no block read, counted,
promoted or written). For a request without faults, the plan explained just before it runs is the plan it carries
out (`Generation.plan`, tested). What it cannot know: a block's tokens (checked when a request reads it) and blend's
recomputed share.
"""

from __future__ import annotations

from dataclasses import dataclass

from .lookups import WhereLookups
from .plan import REUSING_CHUNKS, Load, Plan
from .request import prompt_segments


@dataclass(frozen=True)
class ExplainRow:
    """One piece of an explained prompt: what its slots hold and where their KV would come from."""

    kind: str  # what the slots hold: "bos" | "text" | "sep" | "chunk" | "passage" | "scaffold" | "prefix"
    tokens: int
    slots: tuple[int, int]  # [first, end) in the request's cache
    positions: tuple[int, int]  # position ids of its first and last token
    source: str  # "fresh" | "prefix" | "chunk" | "scaffold" (as `SegmentSource.source`)
    load: str  # how its KV would be obtained: "compute" | "copy" | "read" | "encode" | "stored" (plan.py)
    tier: str | None  # the tier holding its block (None: fresh, or not stored yet)
    kv: str  # the two above in words ("memory hit", "disk hit, read into the buffer", ...)
    key: str | None  # the store key of its block
    text: str  # the start of its text
    relocated: bool = False  # a block encoded on its own and moved here (what APE aligns the attention over)


# How `explain` words each way a piece's KV is obtained (plan.py, `Piece.load`).
_LOADS = {Load.COMPUTE: "computed by the forward", Load.COPY: "{tier} hit",
          Load.READ: "{tier} hit, read into the buffer", Load.ENCODE: "miss: encoded and stored",
          Load.STORED: "encoded above in this prompt"}


@dataclass(frozen=True)
class Explanation:
    """What a request for this prompt would do, before it runs (`Engine.explain`): the plan, as rows."""

    mode: str
    plan: Plan
    rows: tuple[ExplainRow, ...]

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV would come from the store (before blend's recompute and the prompt's last token,
        which is always computed for its logits)."""
        return sum(r.tokens for r in self.rows if r.load in (Load.COPY, Load.READ, Load.STORED))

    @property
    def computed_tokens(self) -> int:
        return sum(r.tokens for r in self.rows if r.load == Load.COMPUTE)

    @property
    def encoded_tokens(self) -> int:
        return sum(r.tokens for r in self.rows if r.load == Load.ENCODE)

    def __str__(self) -> str:
        head = ("kind", "tokens", "slots", "positions", "kv from", "text")
        body = [(r.kind, str(r.tokens), f"{r.slots[0]}-{r.slots[1] - 1}", f"{r.positions[0]}-{r.positions[1]}",
                 r.kv, r.text) for r in self.rows]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
                 for row in [head, *body]]
        lines.append(f"{self.mode}: {len(self.plan.ids)} prompt tokens; {self.reused_tokens} from the store, "
                     f"{self.encoded_tokens} to encode, {self.computed_tokens} computed by the forward; "
                     f"{self.plan.stored_tokens} newly stored")
        if self.plan.align is not None:
            ape, reused = self.plan.align, sum(r.tokens for r in self.rows if r.relocated)
            lines.append(f"APE: the tokens computed after the {reused} reused chunk tokens attend to them with "
                         f"temperature {ape.temperature:g} and scale {ape.scale:g}" if reused else
                         "APE: no reused chunk tokens, nothing to align")
        return "\n".join(lines)


def explain(engine, prompt, mode: str, namespace: str | None, align=None) -> Explanation:
    """`Engine.explain` for a checked namespace. A mode a request would refuse for this model (a RoPE that cannot
    be relocated, a failed relocation self-check) is refused, by what is known without a forward pass."""
    segments, _ = prompt_segments(engine, prompt, mode, namespace)
    if mode in REUSING_CHUNKS:
        engine.runner.check_relocation(probe=False)
    plan = engine.planner.plan(segments, mode, WhereLookups(engine.store), namespace, engine.passages_from_first_sight,
                               align)
    rows = []
    for p in plan.pieces:
        kv = _LOADS[p.load].format(tier=p.origin)
        if p.members:
            kv += f" (an extent of {len(p.members)} blocks)"
        ids = list(plan.ids[p.slot: p.slot + min(p.n, 16)])
        text = engine.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        rows.append(ExplainRow(p.kind, p.n, (p.slot, p.slot + p.n), (p.position, p.position + p.n - 1), p.source,
                               p.load, None if p.load == Load.ENCODE else p.origin, kv, p.key,
                               repr(text[:40]) + ("..." if p.n > 16 else ""), p.relocated))
    return Explanation(mode, plan, tuple(rows))
