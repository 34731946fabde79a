"""From token segments to an assembled cache and the prompt's last logits.

A plan says, for every slot of the prompt, where its KV comes from:
- "prefix":   a block of the automatic exact-prefix chain (prefix.py): KV an earlier request computed after
              exactly the same tokens (its prompt or its reply); identical to a full prefill;
- "chunk":    a chunk encoded on its own after the sink prefix, RoPE-relocated to its place (approximation:
              it never saw the segments before it);
- "scaffold": a declared group of chunks (with the text between them) encoded jointly, relocated as one
              block: exact inside the group, an approximation with respect to what precedes it;
- "fresh":    computed in this request's single forward pass, attending to everything before it.
Planning is plain Python over the store; `assemble` then copies blocks into the request's slots and runs
one forward for all fresh tokens, plus, in `blend` mode, a chosen fraction of the reused chunk tokens,
recomputed with the whole prompt as context (their cached KV is overwritten). `save_prefix` stores, once
the reply is out, the prefix blocks this request computed, so the next request finds them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .blocks import KVBlock, chunk_key, scaffold_key
from .errors import PCRagError, PromptError
from .model import LlamaRunner, SlotCache
from .prefix import (
    BLOCK_TOKENS,
    EXTENT_BLOCKS,
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
from .store import (
    PendingBlock,
    Sink,
    find_many_with_source,
    get_many_with_source,
    get_with_source,
    has_persistent,
    put_block,
    put_persistent,
)

MODES = ("full", "exact", "modular", "blend")
MAX_KNOWN_EXTENTS = 65536  # extent keys remembered (Assembler.extents_stored): ~5 MB
REUSING_CHUNKS = ("modular", "blend")
SELECTIONS = ("chunk_start", "deviation", "progressive")


@dataclass(frozen=True)
class Piece:
    slot: int  # first slot (= index of its first token in the prompt)
    n: int  # tokens
    source: str  # "fresh" | "prefix" | "chunk" | "scaffold"
    kind: str  # what it holds: a segment kind ("bos", "text", "sep", "chunk"), "scaffold", or "prefix"
    position: int  # position id of its first token; a relocated block's tokens have consecutive positions
    key: str | None = None  # store key it came from
    block: KVBlock | None = None  # for a "prefix" piece, its first n tokens are used
    origin: str | None = None  # store tier (or "computed" for a block encoded by this request)
    pending: PendingBlock | None = None  # a block found on disk, not read yet: assemble reads it into its slots
    want: Wanted | None = None  # a pending relocated block: what to encode should reading it fail
    members: tuple[str, ...] = ()  # an extent (prefix.py): the keys of the prefix blocks it holds, in order

    @property
    def block_keys(self) -> tuple[str, ...]:
        """The prefix-chain keys this piece covers: its own, or an extent's blocks'."""
        return self.members or (self.key,)


@dataclass(frozen=True)
class Wanted:
    """A relocated block the prompt needs, before the store is asked: `_layout` collects them all and looks
    them up in one batch (parallel disk reads, one Redis round trip), then encodes the misses."""

    slot: int
    source: str  # "chunk" | "scaffold"
    kind: str  # as Piece.kind
    position: int  # position id of its first token in the prompt
    key: str
    token_ids: tuple[int, ...]
    start: int  # position its KV is encoded at


@dataclass(frozen=True)
class Recompute:
    """Blend: which reused chunk tokens are recomputed with the whole prompt as context.

    ratio:  share of the relocated chunk tokens recomputed (0 = modular, 1 = full), counted in tokens.
    select: "chunk_start" (EPIC): the first tokens of every chunk, the same number from each; no probe.
            "deviation" (CacheBlend, one selection): every chunk token runs layer 0 in context, and from layer 1
            on only the `ratio` share whose layer-1 keys moved most from the cached ones.
            "progressive" (CacheBlend as published): the same, narrowed layer by layer, from PROGRESSIVE_START
            times the share at layer 1 down to the share at the last layer.
            `tokens_per_layer` says what each computes; what each recovers and costs: README, "Blend".
    """

    ratio: float
    select: str  # the engine's `blend_selection`: one default, there

    def __post_init__(self):
        if not 0.0 <= self.ratio <= 1.0:
            raise PCRagError(f"recompute_ratio must be in [0, 1], got {self.ratio}")
        if self.select not in SELECTIONS:
            raise PCRagError(f"unknown blend selection {self.select!r}; choose one of {', '.join(SELECTIONS)}")


@dataclass(frozen=True)
class Plan:
    mode: str
    ids: tuple[int, ...]  # by slot
    positions: tuple[int, ...]  # by slot
    pieces: tuple[Piece, ...]
    layout: tuple[Run | Link, ...]  # the prefix chain's layout, up to where its KV may be stored (prefix.py)
    hits: frozenset[str]  # prefix blocks reused whole (already stored)
    stored_tokens: int  # prompt tokens whose KV this request newly stores (chunks it encodes, prefix blocks)


@dataclass(frozen=True)
class Assembled:
    cache: SlotCache
    logits: torch.Tensor  # [vocab] fp32, next-token logits after the prompt
    plan: Plan
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    recomputed_tokens: int  # reused chunk tokens recomputed by blend (counted in computed_tokens)
    last_position: int

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return self.plan.pieces


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_in_thread(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, bit for bit (CPU tensors of one dtype), by numpy: one thread, GIL released. In the disk
    tier's reader threads torch's copy_ starts an OpenMP team per thread, oversubscribing the cores: measured
    3x slower in all than this (86 against 25 ms for the 250 blocks of an 8K-token prefix, 2 reader threads).
    The integer view makes any float dtype (bfloat16 too, which numpy lacks) a plain copy."""
    as_int = _SAME_SIZE_INT[src.element_size()]
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())


class Assembler:
    """Plans and builds the cache for one prompt, in one of MODES."""

    def __init__(self, runner: LlamaRunner, store, sink_ids: tuple[int, ...], block_tokens: int = BLOCK_TOKENS):
        self.runner = runner
        self.store = store
        self.sink_ids = sink_ids  # what every chunk is encoded after (BOS when the tokenizer has one)
        self.root = "root-" + runner.fingerprint
        self.block_tokens = block_tokens
        self.prefixes = PrefixIndex()  # blocks stored under each parent key, for matches ending inside a block
        # Extents this process wrote or read, so a request whose blocks memory holds singly (all hits) does not
        # write the extent again; one it does not know of is written (a chat that grew past a group, say).
        self.extents_stored: OrderedDict[str, None] = OrderedDict()
        self._extents_lock = threading.Lock()  # requests of a server's batch plan and store concurrently
        # Declared scaffold groups, by their first chunk's tokens: each a tuple of chunk token tuples.
        self.scaffolds: dict[tuple[int, ...], frozenset[tuple[tuple[int, ...], ...]]] = {}
        self.scaffold_bytes = 0  # what joint encodings cost on top of the chunks' own blocks
        self.reuse_separators = True  # whitespace-only text after a chunk is reused like a chunk (see plan)
        self.direct_loads = True  # blocks on disk are read straight into the request buffer (_read_pending)

    def add_scaffold(self, chunks: Sequence[tuple[int, ...]]) -> None:
        if len(chunks) < 2:
            raise PCRagError("a scaffold groups at least two chunks")
        # Copy on write: planning in other threads reads these sets without a lock.
        self.scaffolds[chunks[0]] = self.scaffolds.get(chunks[0], frozenset()) | {tuple(chunks)}

    # ---- planning -------------------------------------------------------------------------------------
    def plan(self, segments: list[TokenSegment], mode: str) -> Plan:
        if mode not in MODES:
            raise PromptError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode in REUSING_CHUNKS:  # refused (UnsupportedModelError) where relocated keys would be wrong
            self.runner.check_relocation()
        ids = tuple(t for s in segments for t in s.token_ids)
        positions = tuple(q for s in segments for q in range(s.start, s.end))
        items = self._layout(segments, mode)
        pieces: list[Piece] = []
        layout: list[Run | Link] = []
        hits: set[str] = set()
        parent, walking, storing = self.root, mode != "full", mode != "full"
        for item in items:
            if isinstance(item, Piece):  # a relocated block
                pieces.append(item)
                if mode == "blend":
                    # Blend recomputes part of the relocated KV in context, so nothing after the first relocated
                    # block has KV that a key could name: the chain stops there.
                    walking = storing = False
                if storing:
                    link = Link(item.slot, item.slot + item.n, item.key, item.position)
                    layout.append(link)
                    parent = after_link(parent, link)
                continue
            run, kinds = item
            covered = run.start
            if walking:
                found = self._lookup_run(parent, ids, positions, run)
                for p in found:
                    pieces.append(p)
                    if p.pending is not None or p.n == len(p.block.token_ids):
                        hits.update((p.key, *p.members))
                        parent = p.block_keys[-1]
                covered = found[-1].slot + found[-1].n if found else run.start
                walking = covered == run.end and (not found or found[-1].key in hits)
            pieces.extend(self._fresh(covered, run.end, kinds, positions))
            if storing:
                layout.append(run)
        if storing and (not layout or isinstance(layout[-1], Link)):
            layout.append(Run(len(ids), len(ids), closed=False))  # the reply, after a prompt ending in a block
        reused = sum(p.n for p in pieces if p.source == "prefix")
        encoded = sum(p.n for p in pieces if p.origin == "computed")
        in_runs = sum(r.end - r.start for r in layout if isinstance(r, Run))
        return Plan(mode, ids, positions, tuple(pieces), tuple(layout), frozenset(hits),
                    stored_tokens=encoded + in_runs - reused)

    def _layout(self, segments: list[TokenSegment], mode: str) -> list:
        """The prompt as relocated blocks (Pieces, fetched or encoded now) and runs of in-context slots
        ((Run, [(first slot, segment kind), ...]) for reporting what the fresh slots hold). Every relocated
        block is looked up in one batch, then the misses are encoded."""
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
            if mode in REUSING_CHUNKS and seg.kind == "chunk":
                end = self._scaffold_end(segments, j)
                if end is not None:
                    want = self._scaffold_wanted(segments[j:end], slot)
                    span = segments[j:end]
                    j = end
                else:
                    want, span = self._chunk_wanted(seg, slot), [seg]
                    j += 1
            elif mode in REUSING_CHUNKS and seg.kind == "sep" and self.reuse_separators and j < len(segments) - 1 \
                    and items and isinstance(items[-1], Wanted) and run_start == slot:
                # Whitespace between chunks ("\n\n" in every RAG template) is reused like a chunk: computing
                # it fresh cost as much as a question of the same length per separator (measured: 14 of the
                # 41 fresh tokens at 4K tokens, +15% TTFT); its KV barely depends on context (see fidelity).
                want, span = self._chunk_wanted(seg, slot), [seg]
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
        found = dict(zip(keys, self._find(keys), strict=True))
        out = []
        for item in items:
            if isinstance(item, Wanted):
                item = self._piece(item, *found[item.key])
                if item.origin == "computed":  # encoded just now: a later use of it in this prompt reads the store
                    found[item.key] = self._get(item.key)
            out.append(item)
        return out

    @staticmethod
    def _fresh(a: int, b: int, kinds: list[tuple[int, str]], positions) -> list[Piece]:
        """Fresh pieces for slots [a, b), one per segment they fall in (so `sources` says what they hold)."""
        out = []
        bounds = [s for s, _ in kinds] + [b]
        for (s, kind), e in zip(kinds, bounds[1:], strict=False):
            lo, hi = max(a, s), min(b, e)
            if lo < hi:
                out.append(Piece(lo, hi - lo, "fresh", kind, positions[lo]))
        return out

    def _lookup_run(self, parent: str, ids, positions, run: Run) -> list[Piece]:
        """Prefix pieces for the longest cached prefix of `run`: whole blocks found by key, or, in the persistent
        tiers, the extents holding them (batched lookups), then the longest common prefix with a block stored
        under the last parent, if any."""
        refs = run_blocks(self.runner.fingerprint, parent, ids, positions, run.start, run.end, run.closed,
                          self.block_tokens)
        singles, spans = self._lookup_blocks(refs, len(ids))
        found: list[Piece] = []
        i = 0
        while i < len(refs):
            span = spans.get(i)
            if span is not None:  # the group from its extent: one entry, not EXTENT_BLOCKS
                members = refs[i: i + EXTENT_BLOCKS]
                piece = self._prefix_piece(members[0].start, members[-1].end, *span, ids, positions,
                                           tuple(r.key for r in members))
            else:
                members = refs[i: i + 1]
                piece = self._prefix_piece(refs[i].start, refs[i].end, refs[i].key, *singles[i], ids, positions)
            if piece is None:
                break  # a miss (or a foreign entry under a colliding key: never use KV of other tokens)
            for ref in members:
                self.prefixes.add(ref.parent, ref.key, ids[ref.start: ref.end], positions[ref.start: ref.end])
            found.append(piece)
            parent = members[-1].key
            i += len(members)
        a = found[-1].slot + found[-1].n if found else run.start
        if a < run.end:
            best = self.prefixes.longest(parent, ids[a: run.end], positions[a: run.end])
            if best is not None:
                key, n = best
                block, origin = self._get(key)
                if block is not None and block.token_ids[:n] == ids[a: a + n]:
                    found.append(Piece(a, n, "prefix", "prefix", positions[a], key, block, origin))
        return found

    @staticmethod
    def _prefix_piece(a: int, b: int, key: str, block, origin, ids, positions,
                      members: tuple[str, ...] = ()) -> Piece | None:
        """The piece for slots [a, b) found under `key` (a PendingBlock: its tokens are checked when it is read), or
        None for a miss or a block of other tokens."""
        pending = block if isinstance(block, PendingBlock) else None
        if pending is not None:
            block = None
        elif block is None or block.token_ids != ids[a: b]:
            return None
        return Piece(a, b - a, "prefix", "prefix", positions[a], key, block, origin, pending, members=members)

    def _lookup_blocks(self, refs: list, total: int) -> tuple[list, dict[int, tuple]]:
        """What the store holds for a run's blocks: per block, (block or PendingBlock or None, origin), and the
        extents to read instead of single blocks, {index of the group's first block: (extent key, block, origin)}.
        With persistent tiers, memory is asked for the single blocks, then the persistent tiers for what a request
        of this prompt's length (`total`) stores there (`far_groups`): extents of the groups far from its end,
        single blocks for the rest; then, for a group not found so, the other form (a prompt of another length
        stored it). Groups memory holds whole are not asked for. So an entry is asked for only where it may exist,
        and the tiers' miss counts stay true."""
        keys = [r.key for r in refs]
        if not has_persistent(self.store):
            return self._find(keys), {}
        singles = self._find(keys, "volatile")
        held = [isinstance(b, KVBlock) for b, _ in singles]
        whole = extents(refs, self.block_tokens)
        groups = {i: k for i, k in whole if not all(held[i: i + EXTENT_BLOCKS])}
        far = dict(far_groups(refs, list(groups.items()), total, self.block_tokens))
        members = {i: [j for j in range(i, i + EXTENT_BLOCKS) if not held[j]] for i in groups}
        grouped = in_groups(whole)
        loose = [j for j in range(len(refs)) if j not in grouped and not held[j]]
        near = [j for i in groups if i not in far for j in members[i]]
        spans: dict[int, tuple] = {}

        def ask(extent_keys: dict[int, str], blocks: list[int]) -> None:
            answers = self._find(list(extent_keys.values()) + [keys[j] for j in blocks], "persistent")
            for (i, k), answer in zip(extent_keys.items(), answers[:len(extent_keys)], strict=True):
                if answer[0] is not None:
                    spans[i] = (k, *answer)
            for j, answer in zip(blocks, answers[len(extent_keys):], strict=True):
                singles[j] = answer

        ask(far, loose + near)
        ask({i: k for i, k in groups.items() if i not in far and any(singles[j][0] is None for j in members[i])},
            [j for i in far if i not in spans for j in members[i]])
        return singles, spans

    def _fetch(self, keys: list[str], tiers: str = "all") -> list[tuple[KVBlock | None, str | None]]:
        if not keys:
            return []
        return [(self.place(b), o) for b, o in get_many_with_source(self.store, keys, tiers)]

    def _find(self, keys: list[str], tiers: str = "all") -> list[tuple[KVBlock | PendingBlock | None, str | None]]:
        """As `_fetch`, but blocks on disk come back unread (PendingBlocks), for `_read_pending`. `tiers`: as for
        `find_many_with_source`."""
        if not keys or not self.direct_loads:
            return self._fetch(keys, tiers)
        found = find_many_with_source(self.store, keys, tiers)
        return [(b if isinstance(b, PendingBlock) else self.place(b), o) for b, o in found]

    def _get(self, key: str) -> tuple[KVBlock | None, str | None]:
        block, origin = get_with_source(self.store, key)
        return self.place(block), origin

    def place(self, block: KVBlock | None) -> KVBlock | None:
        """The block on the model's device. Blocks read from disk or Redis are CPU tensors; the engine hands
        this to a TieredStore to place them once, before promotion, and lookups catch any other store."""
        if block is None or block.keys.device == self.runner.device:
            return block
        keys, values = self.runner.place(block.keys, block.values)
        return KVBlock(keys, values, block.token_ids, block.start, block.meta)

    def _piece(self, want: Wanted, block: KVBlock | PendingBlock | None, origin: str | None) -> Piece:
        """The Piece for a wanted block, given what the store answered; a miss is encoded now and stored. A block
        on disk is read into the request buffer by `assemble` (its tokens are checked then)."""
        if isinstance(block, PendingBlock):
            return Piece(want.slot, len(want.token_ids), want.source, want.kind, want.position, want.key, None, origin,
                         block, want)
        if block is not None and block.token_ids != want.token_ids:
            block = None  # a key collision or a foreign entry: never use KV for other tokens
        if block is None:
            block, origin = self.encode_chunk(want.token_ids, want.start, want.source), "computed"
            self.store.put(want.key, block)
            if want.source == "scaffold":
                self.scaffold_bytes += block.nbytes
        return Piece(want.slot, len(want.token_ids), want.source, want.kind, want.position, want.key, block, origin)

    def _chunk_wanted(self, seg: TokenSegment, slot: int) -> Wanted:
        start = seg.encode_start if seg.encode_start is not None else len(self.sink_ids)
        key = chunk_key(self.runner.fingerprint, seg.token_ids, self.sink_ids, start)
        return Wanted(slot, "chunk", seg.kind, seg.start, key, seg.token_ids, start)

    def chunk_piece(self, seg: TokenSegment, slot: int) -> Piece:
        """A chunk's own block (encoded after the sink, at its encode position), from the store or encoded now."""
        want = self._chunk_wanted(seg, slot)
        return self._piece(want, *self._get(want.key))

    def chunk_keys(self, segments: Sequence[TokenSegment]) -> list[str]:
        """Store keys of the chunks' own blocks (what `chunk_piece` would look up), e.g. to prefetch them."""
        return [self._chunk_wanted(seg, 0).key for seg in segments]

    def _scaffold_end(self, segments: list[TokenSegment], j: int) -> int | None:
        """End index of a declared scaffold group starting at segment j (its chunks in order, separated
        only by text, at consecutive positions), or None."""
        groups = self.scaffolds.get(segments[j].token_ids)
        if not groups:
            return None
        best = None
        for group in groups:  # a frozenset, replaced (never changed) when a builder adds a group
            k, end = 0, j
            while end < len(segments) and k < len(group):
                seg = segments[end]
                if end > j and seg.start != segments[end - 1].end:
                    break
                if seg.kind == "chunk":
                    if seg.token_ids != group[k]:
                        break
                    k += 1
                end += 1
            if k == len(group) and (best is None or end > best):
                best = end
        return best

    def _scaffold_wanted(self, span: list[TokenSegment], slot: int) -> Wanted:
        ids = tuple(t for s in span for t in s.token_ids)
        start = len(self.sink_ids)
        key = scaffold_key(self.runner.fingerprint, [s.token_ids for s in span], self.sink_ids, start)
        return Wanted(slot, "scaffold", "scaffold", span[0].start, key, ids, start)

    def scaffold_piece(self, span: list[TokenSegment], slot: int) -> Piece:
        """The joint block of `span` (chunks and the text between them), from the store or encoded now."""
        want = self._scaffold_wanted(span, slot)
        return self._piece(want, *self._get(want.key))

    @torch.inference_mode()
    def encode_chunk(self, token_ids: tuple[int, ...], start: int, kind: str = "chunk") -> KVBlock:
        """Encode a chunk (or a scaffold group) on its own: sink tokens at 0.., its first token at `start`."""
        n_sink = len(self.sink_ids)
        ids = list(self.sink_ids) + list(token_ids)
        positions = list(range(n_sink)) + list(range(start, start + len(token_ids)))
        cache = self.runner.new_cache(len(ids))
        self.runner.forward(cache, ids, positions, list(range(len(ids))))
        k, v = cache.block_views(n_sink, len(ids))
        return KVBlock(k.clone(), v.clone(), tuple(token_ids), start, {"kind": kind})

    # ---- building -------------------------------------------------------------------------------------
    def assemble(self, plan: Plan, extra_capacity: int, recompute: Recompute | None = None) -> Assembled:
        ids, positions = plan.ids, plan.positions
        total = len(ids)
        cache = self.runner.acquire_cache(total + extra_capacity)
        plan = self._read_pending(plan, cache)
        pieces = plan.pieces
        fresh: set[int] = set()
        cached = 0
        for p in pieces:
            if p.source == "fresh":
                fresh.update(range(p.slot, p.slot + p.n))
                continue
            if p.pending is not None:  # already in its slots
                cached += p.n
                continue
            keys, values = p.block.keys, p.block.values
            if p.n != keys.shape[2]:  # a prefix block shared up to its n-th token
                keys, values = keys[:, :, : p.n], values[:, :, : p.n]
            dk, dv = cache.block_views(p.slot, p.slot + p.n)
            self.runner.relocate(dk, keys, p.position - p.block.start)
            dv.copy_(values)
            if p.origin != "computed":  # encoded by this very request: computed, not reused
                cached += p.n
        # Slots already hold the cached blocks; cache.length must cover them before any forward.
        cache.length = total
        if total - 1 not in fresh:
            # The prompt ends inside a cached block: recompute its last token so we have its logits.
            fresh.add(total - 1)
            if self._reused(pieces, total - 1):
                cached -= 1
        if recompute is not None and recompute.ratio > 0:
            logits, recomputed = self._blend(pieces, cache, ids, positions, fresh, recompute)
        else:
            order = sorted(fresh)
            logits, recomputed = self.runner.forward(cache, [ids[s] for s in order], [positions[s] for s in order],
                                                     order), set()
        reused_recomputed = sum(1 for s in recomputed if self._reused(pieces, s))
        cached -= reused_recomputed
        return Assembled(
            cache=cache,
            logits=logits,
            plan=plan,
            prompt_tokens=total,
            cached_tokens=cached,
            computed_tokens=total - cached,
            recomputed_tokens=reused_recomputed,
            last_position=positions[-1],
        )

    def _read_pending(self, plan: Plan, cache: SlotCache) -> Plan:
        """Reads the plan's pending blocks (found on disk at planning) straight into their slots of `cache`, in the
        disk tier's reader threads: a bit-exact block is read from its file into the slots and checked there, any
        other through a reused staging buffer and copied in; no block gets memory of its own, so a request from
        disk faults in no fresh pages (they cost more than the reads). Relocated blocks' keys are then rotated in
        place to their positions here. The memory tier gets these blocks after the reply (`save_prefix`).
        A block that cannot be used (gone, corrupt, unreadable since planning, or holding other tokens): a prefix
        block leaves its slots to this request's forward (the returned plan has fresh pieces there and no longer
        counts them as hits; the blocks after it stay valid: exact prefix KV depends on the tokens before it,
        never on how their KV was obtained); a relocated block is encoded now and stored, as a miss would be."""
        pending = [p for p in plan.pieces if p.pending is not None]
        if not pending:
            return plan
        # A block used more than once (the separator between chunks) is read once, into its first piece's slots,
        # and copied from there into the others' before any rotation (from the position its keys are at there).
        first: dict[str, Piece] = {}
        for p in pending:
            first.setdefault(p.key, p)
        rotations: list[tuple[torch.Tensor, int]] = []
        starts: dict[str, int] = {}
        reads = list(first.values())
        read = self.store.read_pending([p.pending for p in reads],
                                       [self._sink(p, plan.ids, cache, rotations, starts) for p in reads])
        ok = {p.key for p, got in zip(reads, read, strict=True) if got}
        for p in pending:
            src = first[p.key]
            if p is not src and p.key in ok:
                for dst, orig in zip(cache.block_views(p.slot, p.slot + p.n),
                                     cache.block_views(src.slot, src.slot + src.n), strict=True):
                    dst.copy_(orig)
                if p.position != starts[p.key]:
                    rotations.append((cache.block_views(p.slot, p.slot + p.n)[0], p.position - starts[p.key]))
        for keys, delta in rotations:  # here, not in the reader threads: torch ops there oversubscribe the cores
            self.runner.relocate(keys, keys.clone(), delta)
        failed = {p.slot for p in pending if p.key not in ok}
        if not failed:
            return plan
        pieces = tuple(self._recover(p) if p.pending is not None and p.slot in failed else p
                       for p in plan.pieces)
        lost = [p for p in pending if p.slot in failed]
        for p in lost:
            if p.members:  # gone or damaged: written again after the reply
                with self._extents_lock:
                    self.extents_stored.pop(p.key, None)
        return replace(plan, pieces=pieces, hits=plan.hits - {k for p in lost for k in (p.key, *p.members)},
                       stored_tokens=plan.stored_tokens + sum(p.n for p in lost))

    def _recover(self, p: Piece) -> Piece:
        """The piece for a pending block that could not be read: fresh slots for a prefix block; for a relocated
        block, as for a miss, the block encoded now and stored (which `assemble` copies in), or found in memory
        when a piece of the same block was just recovered."""
        if p.want is None:
            return Piece(p.slot, p.n, "fresh", p.kind, p.position)
        return self._piece(p.want, *self._get(p.want.key))

    def _sink(self, p: Piece, ids: tuple[int, ...], cache: SlotCache, rotations: list[tuple[torch.Tensor, int]],
              starts: dict[str, int]) -> Sink:
        """What takes piece p's block once read and checked (in a reader thread): p's slots, which the disk tier
        reads a bit-exact block straight into (then its tokens are left to check, and a relocated block's keys to
        rotate: noted in `rotations` for the caller), and the copy of any other block (its tensors view a staging
        buffer, valid only during the call) into them. `starts` gets the position its keys are at in p's slots once
        taken (the block's own, or p's when relocated already), by key."""
        want = ids[p.slot: p.slot + p.n]
        dk, dv = cache.block_views(p.slot, p.slot + p.n)
        relocate = self.runner.relocate

        def take(block: KVBlock) -> bool:
            if block.token_ids != want or block.keys.shape != dk.shape:
                return False  # a foreign entry under a colliding key: never use KV of other tokens
            delta = p.position - block.start  # 0 for exact prefix blocks: a plain copy
            if block.keys is dk:  # read in place
                starts[p.key] = block.start
                if delta:
                    rotations.append((dk, delta))
                return True
            starts[p.key] = p.position  # copied in, relocated already
            if delta == 0 and dk.device.type == "cpu" and block.keys.dtype == dk.dtype:
                _copy_in_thread(dk, block.keys)
                _copy_in_thread(dv, block.values)
                return True
            with torch.inference_mode():
                relocate(dk, block.keys, delta)
                dv.copy_(block.values)
            return True

        return Sink(take, dk, dv)

    @staticmethod
    def _reused(pieces: Sequence[Piece], slot: int) -> bool:
        for p in pieces:
            if p.slot <= slot < p.slot + p.n:
                return p.source != "fresh" and p.origin != "computed"
        return False

    def _blend(self, pieces, cache: SlotCache, ids, positions, fresh: set[int],
               recompute: Recompute) -> tuple[torch.Tensor, set[int]]:
        """Blend's forward: the fresh slots plus a `recompute.ratio` share of the relocated chunk tokens, chosen
        by `recompute.select`. Returns the last token's logits and the chunk slots whose KV was recomputed (in
        the last layer)."""
        spans = [[s for s in range(p.slot, p.slot + p.n) if s not in fresh]
                 for p in pieces if p.source in ("chunk", "scaffold")]
        spans = [span for span in spans if span]
        candidates = sorted(s for span in spans for s in span)
        k = round(recompute.ratio * len(candidates))
        runner = self.runner

        def run(chosen: set[int]) -> tuple[torch.Tensor, set[int]]:
            order = sorted(fresh | chosen)
            return runner.forward(cache, [ids[s] for s in order], [positions[s] for s in order], order), chosen

        if k == 0:
            return run(set())
        if recompute.select == "chunk_start":
            return run(set(first_tokens(spans, k)))
        # Key deviation (CacheBlend): every candidate runs layer 0 in context (layer 0's keys never see context,
        # so layer 1 is the first whose keys can show what the chunk missed); from layer 1 on, the candidates
        # whose fresh keys moved least from their cached ones are dropped and keep their cached KV.
        schedule = tokens_per_layer(recompute.select, k, len(candidates), runner.shape.num_layers)
        cand = torch.tensor(candidates, device=cache.keys.device)
        kept: list[torch.Tensor] = []

        def narrow(layer: int, slots: torch.Tensor, keys: torch.Tensor):
            is_cand = torch.isin(slots, cand)
            n = schedule[layer]
            if n >= int(is_cand.sum()):
                return None
            moved = (keys.float() - cache.keys[layer, 0][:, slots].float()).norm(dim=-1).sum(0)  # [rows]
            moved = torch.where(is_cand, moved, torch.inf)  # fresh tokens always stay
            keep = torch.topk(moved, n + int((~is_cand).sum())).indices.sort().values
            kept[:] = [slots[keep]]
            return keep

        order = sorted(fresh | set(candidates))
        logits = runner.forward_layers(cache, [ids[s] for s in order], [positions[s] for s in order], order,
                                       narrow=narrow)
        final = set(kept[0].tolist()) if kept else set(order)
        return logits, final & set(candidates)

    def save_prefix(self, assembled: Assembled, generated: Sequence[int] = (),
                    skip: frozenset[str] = frozenset()) -> frozenset[str]:
        """Store the prefix blocks this request computed, once the reply is out: every block of the plan's
        layout that was not reused whole, the forwarded reply tokens (`generated`, whose KV follows the
        prompt's in the cache) included. Whole blocks and blocks of closed runs go to every tier; the short
        tail of the last run only to memory, since only this process's index can find it. Blocks read from
        disk straight into the request buffer (`_read_pending`) are put into memory here rather than on the
        request path (their copy is fresh memory to fault in), so the next request finds them there: prefix
        blocks copied from the buffer, relocated blocks (whose keys the buffer holds rotated) read again, from
        the page cache by then. Returns the keys written; `skip`: keys an earlier call for this request already
        wrote."""
        plan = assembled.plan
        relocated = [p.pending for p in plan.pieces if p.pending is not None and p.want is not None
                     and p.key not in skip]
        if relocated:
            self.store.promote(relocated)  # pending blocks come from a TieredStore (find_many_with_source)
        written: set[str] = {p.key for p in relocated}
        if not plan.layout:
            return frozenset(written)
        direct = {k for p in plan.pieces if p.pending is not None and p.want is None for k in p.block_keys}
        grouped = has_persistent(self.store)
        total = assembled.prompt_tokens
        ids = plan.ids + tuple(generated)
        positions = plan.positions + tuple(range(assembled.last_position + 1, assembled.last_position + 1
                                                 + len(generated)))
        last = plan.layout[-1]
        replied = isinstance(last, Run) and last.end == total  # the reply continues the layout's last run
        parent = self.root
        for item in plan.layout:
            if isinstance(item, Link):
                parent = after_link(parent, item)
                continue
            end = len(ids) if item is last and replied else item.end
            refs = run_blocks(self.runner.fingerprint, parent, ids, positions, item.start, end, True,
                              self.block_tokens)
            groups = far_groups(refs, extents(refs, self.block_tokens), total, self.block_tokens) if grouped else []
            in_group = in_groups(groups)
            for j, ref in enumerate(refs):
                parent = ref.key
                if (ref.key in plan.hits and ref.key not in direct) or ref.key in skip:
                    continue
                k, v = assembled.cache.block_views(ref.start, ref.end)
                block = KVBlock(k.clone(), v.clone(), ids[ref.start: ref.end], positions[ref.start],
                                {"kind": "prefix"})
                whole = ref.end - ref.start == self.block_tokens or item.closed
                persist = whole and ref.key not in direct and j not in in_group  # else in its extent only
                put_block(self.store, ref.key, block, persist=persist)
                self.prefixes.add(ref.parent, ref.key, block.token_ids, positions[ref.start: ref.end])
                written.add(ref.key)
            for i, key in groups:
                members = refs[i: i + EXTENT_BLOCKS]
                if key in plan.hits:  # read from it
                    self._note_extent(key)
                    continue
                if key in skip or key in self.extents_stored:
                    continue
                a, b = members[0].start, members[-1].end
                k, v = assembled.cache.block_views(a, b)
                block = KVBlock(k.clone(), v.clone(), ids[a:b], positions[a], {"kind": "prefix"})
                put_persistent(self.store, key, block)
                self._note_extent(key)
                written.add(key)
        return frozenset(written)

    def _note_extent(self, key: str) -> None:
        with self._extents_lock:
            self.extents_stored[key] = None
            self.extents_stored.move_to_end(key)
            while len(self.extents_stored) > MAX_KNOWN_EXTENTS:
                self.extents_stored.popitem(last=False)


# Progressive blend keeps PROGRESSIVE_START times the final share at layer 1, one share less at each next layer,
# and the final share from there on: the narrowing happens in the first layers, where key deviation is measured,
# so a deep model pays little more than the share (token-layers: 0.55 of a full recompute at 4 layers, 0.38 at
# 8, 0.24 at 32, for ratio 0.2). Measured on the trained retrieval model (two hop, ratio 0.2, 1,000 prompts; at
# its 4 layers the schedule is 3x, 2x, 1x): starting at 2x recovered 62% / 84% of modular's loss at 3 / 4 chunks,
# 3x 89% / 89%, 5x 93% / 97%, at a growing cost. README "Blend" has the tables.
PROGRESSIVE_START = 3


def tokens_per_layer(select: str, k: int, candidates: int, layers: int) -> list[int]:
    """How many of the `candidates` relocated chunk tokens each layer computes in context, for a final budget of
    `k` tokens. "chunk_start": the same k in every layer. "deviation": all of them in layer 0 (the probe that
    measures deviation at layer 1), then k. "progressive" (CacheBlend's gradual filtering): all in layer 0, then
    PROGRESSIVE_START * k at layer 1, k fewer at each next layer down to k, and k in the last layer."""
    if select == "chunk_start" or k == 0:
        return [k] * layers
    if select == "deviation":
        return [candidates] + [k] * (layers - 1)
    return [candidates] + [k if i == layers - 1 else min(candidates, max(1, PROGRESSIVE_START + 1 - i) * k)
                           for i in range(1, layers)]


def recompute_work(select: str, ratio: float, candidates: int, layers: int) -> float:
    """The share of a full recompute of the chunk tokens (token-layers) that blend at `ratio` computes."""
    k = round(ratio * candidates)
    return sum(tokens_per_layer(select, k, candidates, layers)) / (candidates * layers) if candidates else 0.0


def first_tokens(spans: Sequence[Sequence[int]], k: int) -> list[int]:
    """`k` slots taken from the starts of the chunks (`spans`: each chunk's slots in order), the same number from
    each as far as their lengths allow: the first token of every chunk, then the second, and so on (EPIC's
    chunk-start repair with a budget in tokens rather than a fraction of each chunk)."""
    out: list[int] = []
    depth = 0
    while len(out) < k and any(depth < len(s) for s in spans):
        for span in spans:
            if depth < len(span) and len(out) < k:
                out.append(span[depth])
        depth += 1
    return out
