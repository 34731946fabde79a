"""Planning: where each slot of a prompt gets its KV, decided from the store's answers, as a value.

    token segments + mode + the store's answers to lookups (`Lookups`)  ->  Plan

A plan says, for every slot of the prompt, where its KV comes from (`Piece.source`):
- "prefix":   a block of the automatic exact-prefix chain (prefix.py): KV an earlier request computed after
              exactly the same tokens (its prompt or its reply); identical to a full prefill;
- "chunk":    a chunk encoded on its own after the sink prefix, RoPE-relocated to its place (approximation:
              it never saw the segments before it);
- "scaffold": a declared group of chunks (with the text between them) encoded jointly, relocated as one
              block: exact inside the group, an approximation with respect to what precedes it;
- "fresh":    computed in this request's single forward pass, attending to everything before it;
and how the engine obtains it (`Piece.load`):
- "compute": the request's forward computes it (fresh slots);
- "copy":    the lookup brought the block into memory (a memory hit; a tier that cannot read in place): it is
             copied into the slots, its keys rotated to their positions when relocated;
- "read":    a block on disk or in Redis, read straight into the slots when the cache is built, its tokens
             checked there (a block that cannot be used then: `Plan.after_lost_reads`);
- "encode":  a chunk or scaffold no tier holds: encoded on its own, stored, then copied in;
- "stored":  the block an earlier piece of this prompt encodes: taken from the store once that piece stored it.

Passages (`TokenSegment.passage`: pieces of a plain-string prompt, pc_rag.passages) are text unless planning
chooses to reuse one as a chunk (segment kind "passage", relocated like a chunk): in modular and blend, a passage
whose own encoding is stored, or that an earlier request of the namespace sent (`Planner.passages`; then it is
encoded now and stored, as a chunk's miss; with `first_sight`, any passage), and that starts where the exact
cached prefix has ended. The exact prefix is found first on the prompt as text (`_with_passages`), so a passage
never replaces exact reuse with an approximation, and (without `first_sight`) a prompt with no passage seen before
is planned exactly as it would be without passages.

Keys carry the request's cache namespace (`Plan.namespace`; blocks.py): chunk and scaffold keys, and the root the
prefix chain starts from, so no piece is ever found in another namespace's blocks, nor through the prefix index
(its entries hang under namespaced parents); public chunks (`TokenSegment.public`) are keyed in no namespace.
Automatic scaffolds are counted and declared per namespace too; declared ones (`add_scaffold`) apply to all.

Planning runs no model and holds no tensors. The store is asked through `Lookups`, whose answers are `Found`
values (the tier, and the block's token ids when it is in hand): the engine's `assemble.StoreLookups` keeps the
blocks its answers name for the build, `Engine.explain` passes one that only asks where keys are held
(`Store.where`), and tests pass a dict (tests/test_plan.py). The steps that carry a plan out, in order, are in
assemble.py: encode the misses, build the cache (read, copy, relocate), forward the fresh slots, and, once the
reply is out, save the prefix blocks the request computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from .align import APE
from .blocks import chunk_key, root_key, scaffold_key
from .errors import PCRagError, PromptError, UnsupportedModelError
from .options import MODES
from .passages import PassageIndex
from .prefix import (
    BLOCK_TOKENS,
    EXTENT_BLOCKS,
    BlockRef,
    Link,
    PrefixIndex,
    Run,
    after_link,
    extents,
    far_groups,
    in_groups,
    run_blocks,
)
from .segments import TokenSegment

REUSING_CHUNKS = ("modular", "blend")
RELOCATED_KINDS = ("chunk", "passage")  # segment kinds whose KV is a block of their own, relocated to their place

class Source(StrEnum):
    """What a piece's KV is (the module docstring). A str: `Generation.sources` and `explain` show these values."""

    FRESH = "fresh"
    PREFIX = "prefix"
    CHUNK = "chunk"
    SCAFFOLD = "scaffold"


class Load(StrEnum):
    """How a piece's KV is obtained (the module docstring)."""

    COMPUTE = "compute"
    COPY = "copy"
    READ = "read"
    ENCODE = "encode"
    STORED = "stored"


COMPUTED = "computed"  # a piece's origin when this request encodes its block (else the tier that holds it)


@dataclass(frozen=True)
class Event:
    """A change to a plan while it ran, recorded on it (`Plan.events`) rather than written over it: the piece at
    `slot` could not be carried out as planned ("lost": a block to read was gone, damaged or of other tokens by
    then; "not kept": the store did not give back a block this request had just stored) and `built` was done
    instead. `Plan.as_built` applies them."""

    slot: int
    what: str
    built: Piece


@dataclass(frozen=True)
class Found:
    """The store's answer for one key, as planning sees it: the tier holding the block, its token ids when the
    block is in hand (None: not read yet, its tokens are checked when it is read), and whether it is read straight
    into the request buffer at build time (`direct`) rather than already in memory."""

    tier: str
    token_ids: tuple[int, ...] | None = None
    direct: bool = False


class Lookups(Protocol):
    """What planning asks the store. `find` answers a batch of keys, limited to `tiers` ("all", "volatile": memory,
    "persistent": disk and Redis); `get` reads one block whole (a partial match found through the prefix index);
    `has_persistent`: whether some tier outlives the process (then exact prefixes are looked up as extents too)."""

    has_persistent: bool

    def find(self, keys: Sequence[str], tiers: str = "all") -> list[Found | None]: ...

    def get(self, key: str) -> Found | None: ...


@dataclass(frozen=True)
class Piece:
    """Slots [slot, slot + n) of the prompt and where their KV comes from."""

    slot: int  # first slot (= index of its first token in the prompt)
    n: int  # tokens
    source: Source
    kind: str  # what it holds: a segment kind ("bos", "text", "sep", "chunk", "passage"), "scaffold", or "prefix"
    position: int  # position id of its first token; a relocated block's tokens have consecutive positions
    key: str | None = None  # store key of its block
    origin: str | None = None  # the tier holding the block, COMPUTED when this request encodes it; None if fresh
    load: Load = Load.COMPUTE
    encode_start: int | None = None  # chunk and scaffold blocks: the position their KV is encoded at
    members: tuple[str, ...] = ()  # an extent (prefix.py): the keys of the prefix blocks it holds, in order

    @property
    def block_keys(self) -> tuple[str, ...]:
        """The prefix-chain keys this piece covers: its own, or an extent's blocks'."""
        return self.members or (self.key,)

    @property
    def relocated(self) -> bool:
        """A chunk or scaffold block: encoded at `encode_start`, its keys rotated to `position` when they differ."""
        return self.encode_start is not None


@dataclass(frozen=True)
class Wanted:
    """A relocated block the prompt needs, before the store is asked: planning collects them all and looks them up
    in one batch (parallel disk reads, one Redis round trip)."""

    slot: int
    source: Source  # CHUNK or SCAFFOLD
    kind: str  # as Piece.kind
    position: int  # position id of its first token in the prompt
    key: str
    token_ids: tuple[int, ...]
    start: int  # position its KV is encoded at

    def piece(self, origin: str | None, load: Load) -> Piece:
        return Piece(self.slot, len(self.token_ids), self.source, self.kind, self.position, self.key, origin, load,
                     self.start)


@dataclass(frozen=True)
class Plan:
    mode: str
    ids: tuple[int, ...]  # by slot
    positions: tuple[int, ...]  # by slot
    pieces: tuple[Piece, ...]
    layout: tuple[Run | Link, ...]  # the prefix chain's layout, up to where its KV may be stored (prefix.py)
    hits: frozenset[str]  # prefix blocks reused whole (already stored)
    stored_tokens: int  # prompt tokens whose KV this request newly stores (chunks it encodes, prefix blocks)
    # Prefix blocks found by key: the engine records them in its PrefixIndex when it carries the plan out, so that
    # a later prompt leaving this one inside a block still finds their first tokens.
    found_blocks: tuple[BlockRef, ...] = field(default=(), repr=False)
    namespace: str | None = None  # the request's cache namespace: its keys and prefix root (`Planner.root_for`)
    # The prompt's passages (modular, blend): each as the chunk it would be, reused or not, and the keys of those
    # whose own encoding the store held at planning. After the reply the engine remembers them as sent and, while
    # no other request runs, encodes and stores the others, so the next request can reuse them.
    passages: tuple[Wanted, ...] = field(default=(), repr=False)
    passages_held: frozenset[str] = frozenset()
    events: tuple[Event, ...] = ()  # what changed while it ran (none for a request without faults)
    # APE's temperature and scale on the attention over the reused chunks (align.APE), or None: modular as it is.
    # The prefix chain then stops at the first relocated block, as in blend: what follows was computed with it.
    align: APE | None = None

    def with_events(self, events: Sequence[Event]) -> Plan:
        return replace(self, events=self.events + tuple(events)) if events else self

    def as_built(self) -> Plan:
        """The plan with its events applied: each changed piece replaced by what was built; a block that was lost
        is no longer a hit, and its tokens (and those of a block stored again) are stored by this request. A prefix
        block lost is computed by the forward: the blocks after it stay valid, since exact prefix KV depends on the
        tokens before it, never on how their KV was obtained."""
        if not self.events:
            return self
        built = {e.slot: e.built for e in self.events}
        changed = [p for p in self.pieces if p.slot in built]
        lost = [p for p in changed if p.load == Load.READ]
        return replace(self, pieces=tuple(built.get(p.slot, p) for p in self.pieces), events=(),
                       hits=self.hits - {k for p in lost for k in (p.key, *p.members)},
                       stored_tokens=self.stored_tokens + sum(p.n for p in changed))


class Planner:
    """Plans prompts for one model: the keys its blocks are stored under and where each slot's KV comes from.

    Holds what planning needs to know besides the store: the model's fingerprint (in every key), the sink tokens
    chunks are encoded after, the prefix block size, the scaffold groups (declared: every namespace; automatic:
    the namespace whose prompts made them) and the prefix index (which blocks were stored under each parent key,
    for matches ending inside a block). Plain Python over token ids.
    """

    def __init__(self, fingerprint: str, sink_ids: tuple[int, ...], block_tokens: int = BLOCK_TOKENS,
                 rope_type: str = "default", relocatable: bool = True):
        self.fingerprint = fingerprint
        self.sink_ids = tuple(sink_ids)  # what every chunk is encoded after (BOS when the tokenizer has one)
        self.root = root_key(fingerprint)  # the prefix chain's root in no namespace (`root_for`)
        self.block_tokens = block_tokens
        self.rope_type = rope_type
        self.relocatable = relocatable  # RoPE rotation moves cached keys exactly (else only exact/full modes)
        self.prefixes = PrefixIndex()
        # Declared scaffold groups, by their first chunk's tokens: each a tuple of chunk token tuples.
        self.scaffolds: dict[tuple[int, ...], frozenset[tuple[tuple[int, ...], ...]]] = {}
        # Automatic ones, the same by namespace: a group that one namespace's prompts made frequent changes only
        # its own plans (else another's would show, by encoding it, that the group was retrieved elsewhere).
        self.auto_scaffolds: dict[str | None, dict[tuple[int, ...], frozenset[tuple[tuple[int, ...], ...]]]] = {}
        self.passages = PassageIndex()  # the passages each namespace has sent (`_with_passages`)

    def add_scaffold(self, chunks: Sequence[tuple[int, ...]], namespace: str | None = None,
                     automatic: bool = False) -> None:
        """Declare a group for every namespace, or (`automatic`) for `namespace` only."""
        if len(chunks) < 2:
            raise PCRagError("a scaffold groups at least two chunks")
        groups = self.auto_scaffolds.setdefault(namespace, {}) if automatic else self.scaffolds
        # Copy on write: planning in other threads reads these sets without a lock.
        groups[chunks[0]] = groups.get(chunks[0], frozenset()) | {tuple(chunks)}

    def root_for(self, namespace: str | None) -> str:
        """The parent key of the first prefix block of a prompt in `namespace`."""
        return self.root if namespace is None else root_key(self.fingerprint, namespace)

    # ---- the plan --------------------------------------------------------------------------------------------
    def plan(self, segments: Sequence[TokenSegment], mode: str, lookups: Lookups,
             namespace: str | None = None, first_sight: bool = False, align: APE | None = None) -> Plan:
        """`first_sight`: every passage is worth reusing, sent before or not (`Engine.passages_from_first_sight`).
        `align`: an `align.APE` pair for the attention over the reused chunks (modular, blend), or None."""
        if align is not None and mode not in REUSING_CHUNKS:
            raise PromptError(f"APE aligns attention over reused chunks: mode {mode!r} reuses none")
        if mode not in MODES:
            raise PromptError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode in REUSING_CHUNKS and not self.relocatable:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} rescales with sequence length, so relocating cached keys "
                f"by rotation is not exact; use mode='exact' or mode='full' with this model"
            )
        if mode in REUSING_CHUNKS and any(s.passage for s in segments):
            return self._with_passages(segments, mode, _Asked(lookups), namespace, first_sight, align)
        return self._plan(segments, mode, lookups, namespace, align)

    def _with_passages(self, segments: Sequence[TokenSegment], mode: str, lookups: Lookups,
                       namespace: str | None, first_sight: bool, align: APE | None = None) -> Plan:
        """The plan of a prompt with passages: those worth reusing (stored, or sent before in `namespace`, or any
        with `first_sight`) and lying mostly past the end of the exact cached prefix become relocated chunks; the
        rest stay text. The prefix is what the plan of the prompt as text reuses before its first fresh slot; when
        no passage is worth reusing, that plan is the plan. `lookups` answers each key once (`_Asked`), so the
        second plan asks the store nothing new for the prefix."""
        slots, slot = [], 0
        for seg in segments:
            slots.append(slot)
            slot += len(seg)
        candidates = [(i, self.chunk_wanted(replace(seg, kind="passage"), slots[i], namespace))
                      for i, seg in enumerate(segments) if seg.passage]
        keys = list(dict.fromkeys(w.key for _, w in candidates))
        answers = dict(zip(keys, lookups.find(keys), strict=True))
        held = frozenset(k for k, found in answers.items() if found is not None)
        worth = [(i, w) for i, w in candidates if first_sight or w.key in held or self.passages.seen(namespace, w.key)]
        plan = self._plan(segments, mode, lookups, namespace, align)
        if worth:
            # A passage the exact prefix runs into stays text unless most of it lies past the prefix's end (a few
            # exact tokens are not worth recomputing the rest: two passages may begin with the same words).
            exact_end = next((p.slot for p in plan.pieces if p.source == Source.FRESH), len(plan.ids))
            promoted = {i for i, w in worth if exact_end - w.slot < w.slot + len(w.token_ids) - exact_end}
            if promoted:
                segments = [replace(s, kind="passage") if i in promoted else s for i, s in enumerate(segments)]
                plan = self._plan(segments, mode, lookups, namespace, align)
        return replace(plan, passages=tuple(w for _, w in candidates), passages_held=held)

    def _plan(self, segments: Sequence[TokenSegment], mode: str, lookups: Lookups, namespace: str | None,
              align: APE | None = None) -> Plan:
        ids = tuple(t for s in segments for t in s.token_ids)
        positions = tuple(q for s in segments for q in range(s.start, s.end))
        pieces: list[Piece] = []
        layout: list[Run | Link] = []
        hits: set[str] = set()
        found_blocks: list[BlockRef] = []
        parent, walking, storing = self.root_for(namespace), mode != "full", mode != "full"
        for item in self._layout(segments, mode, lookups, namespace):
            if isinstance(item, Piece):  # a relocated block
                pieces.append(item)
                if mode == "blend" or align is not None:
                    # Blend recomputes part of the relocated KV in context, and APE changes how what follows attends
                    # to it, so nothing after the first relocated block has KV that a key could name: the chain
                    # stops there.
                    walking = storing = False
                if storing:
                    link = Link(item.slot, item.slot + item.n, item.key, item.position)
                    layout.append(link)
                    parent = after_link(parent, link)
                continue
            run, kinds = item
            covered = run.start
            if walking:
                found, refs = self._lookup_run(parent, ids, positions, run, lookups)
                found_blocks += refs
                for p, whole in found:
                    pieces.append(p)
                    if whole:
                        hits.update((p.key, *p.members))
                        parent = p.block_keys[-1]
                covered = found[-1][0].slot + found[-1][0].n if found else run.start
                walking = covered == run.end and (not found or found[-1][1])
            pieces.extend(self._fresh(covered, run.end, kinds, positions))
            if storing:
                layout.append(run)
        if storing and (not layout or isinstance(layout[-1], Link)):
            layout.append(Run(len(ids), len(ids), closed=False))  # the reply, after a prompt ending in a block
        return Plan(mode, ids, positions, tuple(pieces), tuple(layout), frozenset(hits),
                    stored_tokens(pieces, layout), tuple(found_blocks), namespace, align=align)

    def _layout(self, segments: Sequence[TokenSegment], mode: str, lookups: Lookups, namespace: str | None) -> list:
        """The prompt as relocated blocks (Pieces) and runs of in-context slots ((Run, [(first slot, segment
        kind), ...]) for reporting what the fresh slots hold). Every relocated block is looked up in one batch;
        the misses are to be encoded."""
        items: list = []
        run: list[tuple[int, str]] = []
        run_start = slot = 0

        def close_run(end: int, closed: bool) -> None:
            if end > run_start:
                items.append((Run(run_start, end, closed), list(run)))
            run.clear()

        j = 0
        while j < len(segments):
            seg = segments[j]
            want = None
            if mode in REUSING_CHUNKS and seg.kind in RELOCATED_KINDS:
                end = self._scaffold_end(segments, j, namespace)
                if end is not None:
                    want = self.scaffold_wanted(segments[j:end], slot, namespace)
                    span = segments[j:end]
                    j = end
                else:
                    want, span = self.chunk_wanted(seg, slot, namespace), [seg]
                    j += 1
            elif mode in REUSING_CHUNKS and seg.kind == "sep" and j < len(segments) - 1 \
                    and items and isinstance(items[-1], Wanted) and run_start == slot:
                # Whitespace between chunks ("\n\n" in every RAG template) is reused like a chunk: computing
                # it fresh cost as much as a question of the same length per separator (measured: 14 of the
                # 41 fresh tokens at 4K tokens, +15% TTFT); its KV barely depends on context (docs/speed.md).
                want, span = self.chunk_wanted(seg, slot, namespace), [seg]
                j += 1
            if want is not None:
                close_run(slot, closed=True)
                items.append(want)
                slot += sum(len(s) for s in span)
                run_start = slot
                continue
            run.append((slot, seg.kind))
            slot += len(seg)
            j += 1
        close_run(slot, closed=False)
        keys = list(dict.fromkeys(w.key for w in items if isinstance(w, Wanted)))
        found = dict(zip(keys, lookups.find(keys), strict=True)) if keys else {}
        encoded: set[str] = set()
        return [self._relocated(item, found[item.key], encoded) if isinstance(item, Wanted) else item
                for item in items]

    @staticmethod
    def _relocated(want: Wanted, found: Found | None, encoded: set[str]) -> Piece:
        """The piece for a wanted block, given what the store answered; `encoded`: keys an earlier piece encodes."""
        if want.key in encoded:
            return want.piece(None, Load.STORED)  # the store answers for it once the earlier piece stored it
        if found is not None and found.token_ids is not None and found.token_ids != want.token_ids:
            found = None  # a key collision or a foreign entry: never use KV for other tokens
        if found is None:
            encoded.add(want.key)
            return want.piece(COMPUTED, Load.ENCODE)
        return want.piece(found.tier, Load.READ if found.direct else Load.COPY)

    @staticmethod
    def _fresh(a: int, b: int, kinds: list[tuple[int, str]], positions) -> list[Piece]:
        """Fresh pieces for slots [a, b), one per segment they fall in (so `sources` says what they hold)."""
        out = []
        bounds = [s for s, _ in kinds] + [b]
        for (s, kind), e in zip(kinds, bounds[1:], strict=False):
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                out.append(Piece(lo, hi - lo, Source.FRESH, kind, positions[lo]))
        return out

    def _lookup_run(self, parent: str, ids, positions, run: Run,
                    lookups: Lookups) -> tuple[list[tuple[Piece, bool]], list[BlockRef]]:
        """Prefix pieces for the longest cached prefix of `run`, each with whether its block is used whole: whole
        blocks found by key, or, in the persistent tiers, the extents holding them (batched lookups), then the
        longest common prefix with a block stored under the last parent, if any. Also the blocks found by key."""
        refs = run_blocks(self.fingerprint, parent, ids, positions, run.start, run.end, run.closed,
                          self.block_tokens)
        singles, spans = self._lookup_blocks(refs, len(ids), lookups)
        found: list[tuple[Piece, bool]] = []
        found_refs: list[BlockRef] = []
        i = 0
        while i < len(refs):
            span = spans.get(i)
            if span is not None:  # the group from its extent: one entry, not EXTENT_BLOCKS
                members = refs[i: i + EXTENT_BLOCKS]
                piece = self._prefix_piece(members[0].start, members[-1].end, *span, ids, positions,
                                           tuple(r.key for r in members))
            else:
                members = refs[i: i + 1]
                piece = self._prefix_piece(refs[i].start, refs[i].end, refs[i].key, singles[i], ids, positions)
            if piece is None:
                break  # a miss (or a foreign entry under a colliding key: never use KV of other tokens)
            found_refs += members
            found.append((piece, True))
            parent = members[-1].key
            i += len(members)
        a = found[-1][0].slot + found[-1][0].n if found else run.start
        if a < run.end:
            best = self.prefixes.longest(parent, ids[a: run.end], positions[a: run.end], touch=False)
            if best is not None:
                key, n = best
                answer = lookups.get(key)  # read whole: only its first n tokens are used
                if answer is not None and (answer.token_ids is None or answer.token_ids[:n] == ids[a: a + n]):
                    # Whole from the index's own count, so that `explain` (whose answers carry no tokens) plans it
                    # as the request does.
                    whole = n == self.prefixes.tokens(key)
                    found.append((Piece(a, n, Source.PREFIX, "prefix", positions[a], key, answer.tier, Load.COPY),
                                  whole))
        return found, found_refs

    @staticmethod
    def _prefix_piece(a: int, b: int, key: str, found: Found | None, ids, positions,
                      members: tuple[str, ...] = ()) -> Piece | None:
        """The piece for slots [a, b) found under `key`, or None for a miss or a block of other tokens (a block not
        read yet has its tokens checked when it is read)."""
        if found is None or (found.token_ids is not None and found.token_ids != ids[a: b]):
            return None
        return Piece(a, b - a, Source.PREFIX, "prefix", positions[a], key, found.tier,
                     Load.READ if found.direct else Load.COPY, members=members)

    def _lookup_blocks(self, refs: list[BlockRef], total: int,
                       lookups: Lookups) -> tuple[list[Found | None], dict[int, tuple[str, Found]]]:
        """What the store holds for a run's blocks: per block, its answer, and the extents to read instead of
        single blocks, {index of the group's first block: (extent key, answer)}. With persistent tiers, memory is
        asked for the single blocks, then the persistent tiers for what a request of this prompt's length (`total`)
        stores there (`far_groups`): extents of the groups far from its end, single blocks for the rest; then, for
        a group not found so, the other form (a prompt of another length stored it). Groups memory holds whole are
        not asked for. So an entry is asked for only where it may exist, and the tiers' miss counts stay true."""
        keys = [r.key for r in refs]
        if not lookups.has_persistent:
            return (lookups.find(keys) if keys else []), {}
        singles = lookups.find(keys, "volatile") if keys else []
        held = [answer is not None for answer in singles]
        whole = extents(refs, self.block_tokens)
        groups = {i: k for i, k in whole if not all(held[i: i + EXTENT_BLOCKS])}
        far = dict(far_groups(refs, list(groups.items()), total, self.block_tokens))
        members = {i: [j for j in range(i, i + EXTENT_BLOCKS) if not held[j]] for i in groups}
        grouped = in_groups(whole)
        loose = [j for j in range(len(refs)) if j not in grouped and not held[j]]
        near = [j for i in groups if i not in far for j in members[i]]
        spans: dict[int, tuple[str, Found]] = {}

        def ask(extent_keys: dict[int, str], blocks: list[int]) -> None:
            asked = list(extent_keys.values()) + [keys[j] for j in blocks]
            answers = lookups.find(asked, "persistent") if asked else []
            for (i, k), answer in zip(extent_keys.items(), answers[:len(extent_keys)], strict=True):
                if answer is not None:
                    spans[i] = (k, answer)
            for j, answer in zip(blocks, answers[len(extent_keys):], strict=True):
                singles[j] = answer

        ask(far, loose + near)
        ask({i: k for i, k in groups.items() if i not in far and any(singles[j] is None for j in members[i])},
            [j for i in far if i not in spans for j in members[i]])
        return singles, spans

    # ---- keys --------------------------------------------------------------------------------------------------
    def chunk_wanted(self, seg: TokenSegment, slot: int = 0, namespace: str | None = None) -> Wanted:
        """A chunk's own block: encoded after the sink, at its encode position; keyed in `namespace` unless the
        chunk is public."""
        start = seg.encode_start if seg.encode_start is not None else len(self.sink_ids)
        key = chunk_key(self.fingerprint, seg.token_ids, self.sink_ids, start, None if seg.public else namespace)
        return Wanted(slot, Source.CHUNK, seg.kind, seg.start, key, seg.token_ids, start)

    def chunk_keys(self, segments: Sequence[TokenSegment], namespace: str | None = None) -> list[str]:
        """Store keys of the chunks' own blocks (what planning looks up for them), e.g. to prefetch them."""
        return [self.chunk_wanted(seg, 0, namespace).key for seg in segments]

    def scaffold_wanted(self, span: Sequence[TokenSegment], slot: int = 0, namespace: str | None = None) -> Wanted:
        """The joint block of `span` (chunks and the text between them), keyed in `namespace` even when its chunks
        are public: the group and the text between them are the request's own."""
        ids = tuple(t for s in span for t in s.token_ids)
        start = len(self.sink_ids)
        key = scaffold_key(self.fingerprint, [s.token_ids for s in span], self.sink_ids, start, namespace)
        return Wanted(slot, Source.SCAFFOLD, "scaffold", span[0].start, key, ids, start)

    def _scaffold_end(self, segments: Sequence[TokenSegment], j: int, namespace: str | None = None) -> int | None:
        """End index of a declared (or, in `namespace`, automatic) scaffold group starting at segment j (its
        chunks in order, separated only by text, at consecutive positions), or None."""
        first = segments[j].token_ids
        declared = self.scaffolds.get(first, frozenset())
        automatic = self.auto_scaffolds.get(namespace, {}).get(first, frozenset())
        groups = declared | automatic if automatic else declared
        if not groups:
            return None
        best = None
        for group in groups:  # a frozenset, replaced (never changed) when a builder adds a group
            k, end = 0, j
            while end < len(segments) and k < len(group):
                seg = segments[end]
                if end > j and seg.start != segments[end - 1].end:
                    break
                if seg.kind in RELOCATED_KINDS:
                    if seg.token_ids != group[k]:
                        break
                    k += 1
                end += 1
            if k == len(group) and (best is None or end > best):
                best = end
        return best


class _Asked:
    """`Lookups` that ask the store about each key (and tier set) once: a passage plan asks about the prompt twice
    (as text, then with passages reused), and the store's counters should count a request's lookups once."""

    def __init__(self, lookups: Lookups):
        self.lookups = lookups
        self.has_persistent = lookups.has_persistent
        self._found: dict[tuple[str, str], Found | None] = {}

    def find(self, keys: Sequence[str], tiers: str = "all") -> list[Found | None]:
        new = [k for k in dict.fromkeys(keys) if (k, tiers) not in self._found]
        if new:
            self._found.update(((k, tiers), a) for k, a in zip(new, self.lookups.find(new, tiers), strict=True))
        return [self._found[k, tiers] for k in keys]

    def get(self, key: str) -> Found | None:
        if (key, "get") not in self._found:
            self._found[key, "get"] = self.lookups.get(key)
        return self._found[key, "get"]


def stored_tokens(pieces: Sequence[Piece], layout: Sequence[Run | Link]) -> int:
    """Prompt tokens whose KV a request newly stores: the chunks and scaffolds it encodes, and the slots of the
    prefix chain's runs that it did not reuse."""
    reused = sum(p.n for p in pieces if p.source == Source.PREFIX)
    encoded = sum(p.n for p in pieces if p.origin == COMPUTED)
    in_runs = sum(r.end - r.start for r in layout if isinstance(r, Run))
    return encoded + in_runs - reused
