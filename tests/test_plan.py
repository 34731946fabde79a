"""Planning as a value (pc_rag/plan.py), with no model and no tensors: a dict stands in for the store.

References: the keys and slots worked out by hand from the layout rules (each relocated block keyed by
`chunk_key`, each prefix block by `run_blocks`), and the questions the store is asked, in order (batched once,
each key once). Nothing here loads a model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pc_rag.blocks import chunk_key
from pc_rag.errors import PromptError, UnsupportedModelError
from pc_rag.plan import Event, Found, Load, Piece, Planner, Source
from pc_rag.prefix import EXTENT_BLOCKS, Link, Run, after_link, extent_key, run_blocks
from pc_rag.segments import TokenSegment

COMPUTE, COPY, READ, ENCODE, STORED = Load.COMPUTE, Load.COPY, Load.READ, Load.ENCODE, Load.STORED

FP = "fp"
SINK = (1,)
BT = 4  # tokens per prefix block: small, so a few tokens make several blocks
PERSISTENT = ("disk", "redis")


class Shelf:
    """The store as planning sees it: {key: (tier, token ids)}. Persistent tiers answer unread (direct, no token
    ids), memory with the block's token ids. Records every question, to check what is asked and how often."""

    def __init__(self, held: dict | None = None, has_persistent: bool = False):
        self.held = dict(held or {})
        self.has_persistent = has_persistent
        self.asked: list[tuple[str, list[str]]] = []

    def _answer(self, key: str, tiers: str = "all") -> Found | None:
        entry = self.held.get(key)
        if entry is None:
            return None
        tier, ids = entry
        if tiers != "all" and (tiers == "persistent") != (tier in PERSISTENT):
            return None
        return Found(tier, None, True) if tier in PERSISTENT else Found(tier, ids)

    def find(self, keys, tiers="all"):
        self.asked.append((tiers, list(keys)))
        return [self._answer(k, tiers) for k in keys]

    def get(self, key):
        self.asked.append(("get", [key]))
        entry = self.held.get(key)
        return None if entry is None else Found(entry[0], entry[1])


def segments(*specs: tuple[str, tuple[int, ...]]) -> list[TokenSegment]:
    """Segments at consecutive positions from 0."""
    out, pos = [], 0
    for kind, ids in specs:
        out.append(TokenSegment(kind, ids, pos))
        pos += len(ids)
    return out


RAG = segments(("bos", (1,)), ("text", (10, 11, 12, 13, 14)), ("chunk", (20, 21, 22)), ("sep", (30,)),
               ("chunk", (40, 41, 42, 43)), ("text", (50, 51)))


def planner() -> Planner:
    return Planner(FP, SINK, block_tokens=BT)


def ckey(ids) -> str:
    return chunk_key(FP, tuple(ids), SINK, len(SINK))


def summary(plan) -> list[tuple]:
    return [(p.slot, p.n, p.source, p.kind, p.load, p.origin) for p in plan.pieces]


def test_a_cold_store_plans_encodes_for_chunks_and_the_forward_for_text():
    shelf = Shelf()
    plan = planner().plan(RAG, "modular", shelf)
    assert summary(plan) == [
        (0, 1, "fresh", "bos", COMPUTE, None), (1, 5, "fresh", "text", COMPUTE, None),
        (6, 3, "chunk", "chunk", ENCODE, "computed"), (9, 1, "chunk", "sep", ENCODE, "computed"),
        (10, 4, "chunk", "chunk", ENCODE, "computed"), (14, 2, "fresh", "text", COMPUTE, None)]
    a, sep, b = (p for p in plan.pieces if p.relocated)
    assert (a.key, sep.key, b.key) == (ckey((20, 21, 22)), ckey((30,)), ckey((40, 41, 42, 43)))
    assert a.encode_start == 1 and a.position == 6  # encoded after the sink, relocated to its place
    # the relocated blocks asked first, in one batch; then the first run's blocks (the last run is shorter than a
    # block and open: nothing to ask)
    refs = run_blocks(FP, "root-" + FP, plan.ids, plan.positions, 0, 6, True, BT)
    assert shelf.asked == [("all", [a.key, sep.key, b.key]), ("all", [r.key for r in refs])]
    assert plan.layout == (Run(0, 6, True), Link(6, 9, a.key, 6), Link(9, 10, sep.key, 9), Link(10, 14, b.key, 10),
                           Run(14, 16, False))
    assert plan.stored_tokens == 16 and plan.hits == frozenset()  # everything is new


def test_a_block_used_twice_is_asked_once_and_encoded_once():
    repeated = segments(("bos", (1,)), ("chunk", (20, 21)), ("sep", (30,)), ("chunk", (40,)), ("sep", (30,)),
                        ("chunk", (20, 21)), ("text", (50,)))
    shelf = Shelf()
    plan = planner().plan(repeated, "modular", shelf)
    loads = [(p.kind, p.load) for p in plan.pieces if p.relocated]
    assert loads == [("chunk", ENCODE), ("sep", ENCODE), ("chunk", ENCODE), ("sep", STORED), ("chunk", STORED)]
    assert shelf.asked[0] == ("all", [ckey((20, 21)), ckey((30,)), ckey((40,))])
    assert plan.stored_tokens == 2 + 1 + 1 + 1 + 1  # the three blocks once, the bos and the question's runs


def test_a_warm_store_plans_copies_from_memory_and_reads_from_disk():
    held = {ckey((20, 21, 22)): ("memory", (20, 21, 22)), ckey((30,)): ("memory", (30,)),
            ckey((40, 41, 42, 43)): ("disk", None)}
    plan = planner().plan(RAG, "modular", Shelf(held))
    assert [(p.load, p.origin) for p in plan.pieces if p.relocated] == [(COPY, "memory"), (COPY, "memory"),
                                                                        (READ, "disk")]
    assert plan.stored_tokens == 6 + 2  # only the runs' slots: the chunks are reused


def test_a_foreign_entry_under_a_key_is_a_miss():
    """A block whose tokens differ from the prompt's (a colliding key) is never used: encoded instead."""
    plan = planner().plan(RAG, "modular", Shelf({ckey((20, 21, 22)): ("memory", (99, 99, 99))}))
    assert next(p for p in plan.pieces if p.relocated).load == ENCODE


def stored_prefix(ids, positions, start, end, closed, tier="memory", parent=None):
    refs = run_blocks(FP, parent or "root-" + FP, ids, positions, start, end, closed, BT)
    return refs, {r.key: (tier, tuple(ids[r.start: r.end])) for r in refs}


def test_exact_reuses_the_longest_chain_of_whole_blocks_and_stops_at_a_miss():
    prompt = segments(("bos", (1,)), ("text", tuple(range(100, 113))))  # 14 tokens: blocks 0-3, 4-7, 8-11, 12-13
    ids = tuple(t for s in prompt for t in s.token_ids)
    positions = tuple(range(len(ids)))
    refs, held = stored_prefix(ids, positions, 0, 12, False)
    del held[refs[1].key]  # evicted: the chain breaks there, and block 2 is not used although it is held
    plan = planner().plan(prompt, "exact", Shelf(held))
    assert summary(plan) == [(0, 4, "prefix", "prefix", COPY, "memory"), (4, 10, "fresh", "text", COMPUTE, None)]
    assert plan.hits == {refs[0].key} and plan.found_blocks == (refs[0],)
    assert plan.stored_tokens == 10


def test_a_partial_match_through_the_index_reuses_the_shared_tokens():
    """A stored block sharing the first tokens of the prompt's next block (prefix.PrefixIndex): its first 3 of 4
    tokens are reused, not as a hit (it is not the prompt's block), and nothing after it."""
    p = planner()
    prompt = segments(("bos", (1,)), ("text", (100, 101, 102, 103, 104, 105, 106)))
    ids = tuple(t for s in prompt for t in s.token_ids)
    other = ids[4:7] + (999,)
    refs, held = stored_prefix(ids, tuple(range(8)), 0, 4, True)
    child = "prefix-" + "ab" * 20
    p.prefixes.add(refs[0].key, child, other, range(4, 8))
    held[child] = ("memory", other)
    indexed = len(p.prefixes)
    plan = p.plan(prompt, "exact", Shelf(held))
    assert summary(plan) == [(0, 4, "prefix", "prefix", COPY, "memory"), (4, 3, "prefix", "prefix", COPY, "memory"),
                             (7, 1, "fresh", "text", COMPUTE, None)]
    assert plan.pieces[1].key == child and child not in plan.hits
    assert len(p.prefixes) == indexed  # planning adds nothing to the index: the engine does, carrying the plan out


def test_extents_are_asked_of_the_persistent_tiers_after_memory():
    """A long run with persistent tiers (3 groups of 8 blocks): memory is asked for the single blocks, then the
    persistent tiers, in one batch, for the extents of the two groups that end far from the prompt's end (one entry
    for 8 blocks each) and the single blocks of the last group; a far group whose extent is missing is then asked
    for as single blocks (a prompt of another length stored it so)."""
    n = 3 * EXTENT_BLOCKS * BT
    prompt = segments(("text", tuple(range(1000, 1000 + n))))
    ids = prompt[0].token_ids
    refs = run_blocks(FP, "root-" + FP, ids, range(n), 0, n, False, BT)
    g0, g1 = (extent_key(refs[i + EXTENT_BLOCKS - 1].key) for i in (0, EXTENT_BLOCKS))
    last = {r.key: ("disk", None) for r in refs[2 * EXTENT_BLOCKS:]}
    shelf = Shelf({g0: ("disk", None), g1: ("disk", None)} | last, has_persistent=True)
    plan = planner().plan(prompt, "exact", shelf)
    first = plan.pieces[0]
    assert (first.key, first.n, first.load, first.members) == (g0, EXTENT_BLOCKS * BT, READ,
                                                                 tuple(r.key for r in refs[:EXTENT_BLOCKS]))
    assert [p.key for p in plan.pieces] == [g0, g1, *last]
    assert [q[0] for q in shelf.asked] == ["volatile", "persistent"]
    assert shelf.asked[1][1] == [g0, g1, *last]  # the far groups asked whole, the near one block by block
    assert {g0, *first.members} <= plan.hits
    assert sum(p.n for p in plan.pieces if p.source == "prefix") == n

    shelf = Shelf({g0: ("disk", None)} | {r.key: ("disk", None) for r in refs[EXTENT_BLOCKS:]}, has_persistent=True)
    plan = planner().plan(prompt, "exact", shelf)
    assert [q[0] for q in shelf.asked] == ["volatile", "persistent", "persistent"]
    assert shelf.asked[2][1] == [r.key for r in refs[EXTENT_BLOCKS: 2 * EXTENT_BLOCKS]]  # g1, as single blocks
    assert [p.key for p in plan.pieces] == [g0, *(r.key for r in refs[EXTENT_BLOCKS:])]


def test_blend_stops_the_prefix_chain_at_the_first_relocated_block():
    shelf = Shelf()
    plan = planner().plan(RAG, "blend", shelf)
    assert plan.layout == (Run(0, 6, True),)  # nothing after a relocated block: blend recomputes part of it
    assert len(shelf.asked) == 2  # the relocated batch and the first run; the last run is not looked up


def test_full_mode_asks_the_store_nothing():
    shelf = Shelf()
    plan = planner().plan(RAG, "full", shelf)
    assert {p.load for p in plan.pieces} == {COMPUTE} and shelf.asked == [] and plan.layout == ()
    assert sum(p.n for p in plan.pieces) == 16


def test_lost_reads_become_the_forward_and_no_longer_count_as_hits():
    prompt = segments(("bos", (1,)), ("text", tuple(range(100, 111))))  # 12 tokens: 3 whole blocks
    ids = tuple(t for s in prompt for t in s.token_ids)
    refs, held = stored_prefix(ids, tuple(range(12)), 0, 12, False, tier="disk")
    plan = planner().plan(prompt, "exact", Shelf(held))
    assert [p.load for p in plan.pieces] == [READ, READ, READ]
    lost = plan.pieces[1]
    ran = plan.with_events([Event(lost.slot, "lost", Piece(lost.slot, lost.n, Source.FRESH, lost.kind,
                                                           lost.position))])
    built = ran.as_built()
    assert summary(built)[1] == (4, 4, "fresh", "prefix", COMPUTE, None)
    assert built.hits == plan.hits - {refs[1].key} and built.stored_tokens == plan.stored_tokens + 4
    assert plan.pieces[1].load == READ == ran.pieces[1].load  # plans are values: what ran is recorded, not written
    assert ran.events and not built.events and plan.as_built() is plan


def test_plans_hold_no_tensors_and_compare_by_value():
    a, b = (planner().plan(RAG, "modular", Shelf()) for _ in range(2))
    assert a == b
    values = dataclasses.astuple(a)

    def walk(x):
        assert not isinstance(x, torch.Tensor)
        if isinstance(x, (tuple, list, frozenset)):
            for y in x:
                walk(y)

    walk(values)


def test_bad_modes_and_non_relocatable_models_are_refused():
    with pytest.raises(PromptError, match="unknown mode 'fast'"):
        planner().plan(RAG, "fast", Shelf())
    dynamic = Planner(FP, SINK, rope_type="dynamic", relocatable=False)
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        dynamic.plan(RAG, "modular", Shelf())
    assert dynamic.plan(RAG, "exact", Shelf()).mode == "exact"


def test_pieces_name_their_blocks():
    assert Piece(0, 4, "prefix", "prefix", 0, "extent-x", members=("a", "b")).block_keys == ("a", "b")
    assert Piece(0, 4, "prefix", "prefix", 0, "prefix-x").block_keys == ("prefix-x",)
    assert after_link("root", Link(0, 1, "chunk-x", 5)) != after_link("root", Link(0, 1, "chunk-x", 6))
