"""Carrying a plan out (plan.py decides; this file does), in the order the engine runs the steps:

    encode   the chunks and scaffolds no tier holds, each on its own after the sink tokens, and store them;
    build    the request's cache: blocks on disk or in Redis read straight into their slots (`_read`), the rest
             copied in, relocated blocks' keys rotated to their positions (RoPE), lost reads recomputed;
    forward  one forward for all fresh slots, plus, in `blend` mode, a chosen share of the reused chunk tokens,
             recomputed with the whole prompt as context (their cached KV is overwritten);
    save     once the reply is out (`save_prefix`): the prefix blocks this request computed, so the next request
             finds them.

`assemble` runs the first three and returns the cache with the prompt's last logits; the engine decodes from there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .align import aligned_slots
from .blocks import KVBlock
from .errors import PCRagError
from .lookups import StoreLookups
from .model import HeldBlock, LlamaRunner, SlotCache
from .model.aligned import Aligned
from .plan import COMPUTED, Event, Load, Piece, Plan, Planner, Source, Wanted
from .prefix import EXTENT_BLOCKS, Link, Run, after_link, extents, far_groups, in_groups, run_blocks
from .store import PendingBlock, ReadTarget, Store

MAX_KNOWN_EXTENTS = 65536  # extent keys remembered (Assembler.extents_stored): ~5 MB
SELECTIONS = ("chunk_start", "deviation", "progressive", "shift")


@dataclass(frozen=True)
class Recompute:
    """Blend: which reused chunk tokens are recomputed with the whole prompt as context.

    ratio:  share of the relocated chunk tokens recomputed (0 = modular, 1 = full), counted in tokens.
    select: "chunk_start" (EPIC): the first tokens of every chunk, the same number from each; no probe.
            "deviation" (CacheBlend, one selection): every chunk token runs layer 0 in context, and from layer 1
            on only the `ratio` share whose layer-1 keys moved most from the cached ones.
            "progressive" (CacheBlend as published): the same, narrowed layer by layer, from PROGRESSIVE_START
            times the share at layer 1 down to the share at the last layer.
            "shift": progressive without running layer 0 over every chunk token: a cheaper probe
            (`LlamaRunner.context_shift`: how far layer 0's attention output moves in context, no layer run)
            picks the PROGRESSIVE_START * ratio share that layer 0 computes, and layer 1 on narrows as
            progressive does.
            `tokens_per_layer` says what each computes; what each recovers and costs: docs/results.md, "Blend".
    target: a quality target in [0, 1] instead of a fixed ratio (`Engine.recompute_target`): the probe measures
            each candidate's key deviation at layer 1 (how far its cached keys are from keys computed in context,
            relative to their size), and the fewest tokens are recomputed, those that deviate most, for the
            deviation left to be at most (1 - target) of the prompt's own, and never below (1 - target) of
            `reference` per token (the model's typical deviation of a chunk after unrelated ones:
            quality.deviation_reference). A prompt whose chunks barely deviate costs the probe only (modular's KV),
            one where they deviate much gets more; 1 recomputes every token that deviates at all (full), 0 none
            (modular). Narrowed as "progressive" from there. With select "shift" the cheap probe is read instead
            (each candidate's layer-0 shift relative to its in-context output, against the model's reference
            shift): layer 0 then runs only over the tokens it picks, as fixed "shift" does.
    """

    ratio: float
    select: str  # the engine's `blend_selection`: one default, there
    target: float | None = None
    reference: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.ratio <= 1.0:
            raise PCRagError(f"recompute_ratio must be in [0, 1], got {self.ratio}")
        if self.target is not None and not 0.0 <= self.target <= 1.0:
            raise PCRagError(f"recompute_target must be None or in [0, 1], got {self.target}")
        if self.select not in SELECTIONS:
            raise PCRagError(f"unknown blend selection {self.select!r}; choose one of {', '.join(SELECTIONS)}")


@dataclass(frozen=True)
class Assembled:
    cache: SlotCache
    # [vocab] fp32, next-token logits after the prompt; None where the prompt's last `deferred` tokens were left
    # to the caller (`assemble(defer=...)`: the batched decode step computes them, slots from prompt_tokens -
    # deferred on)
    logits: torch.Tensor | None
    plan: Plan  # the plan carried out, with what changed while it ran as events (`Plan.as_built` applies them)
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    recomputed_tokens: int  # reused chunk tokens recomputed by blend (counted in computed_tokens)
    last_position: int
    read: Mapping[str, PendingBlock]  # blocks read straight into the cache, by key (`save_prefix` promotes them)
    deferred: int = 0  # the prompt's last tokens left to the caller to compute (logits None)
    deviation: float | None = None  # blend's probe: the mean relative key deviation of the reused chunk tokens

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The pieces as built (events applied)."""
        return self.plan.as_built().pieces


@dataclass
class EncodeCounts:
    """Chunks encoded on their own (`Assembler.encode_chunks`), in one place, since the engine started."""

    forwards: int = 0  # passes through the model (a batched pass of many chunks is one, unless split: encode_apart)
    chunks: int = 0
    tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, forwards: int, chunks: int, tokens: int) -> None:
        with self._lock:
            self.forwards += forwards
            self.chunks += chunks
            self.tokens += tokens

    def as_dict(self) -> dict:
        with self._lock:
            return {"forwards": self.forwards, "chunks": self.chunks, "tokens": self.tokens}


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _held(p: Piece) -> HeldBlock:
    """What piece p's slots hold once its block is in them."""
    return HeldBlock(p.key, p.slot, p.n, p.position)


def _copy_in_thread(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, bit for bit (CPU tensors of one dtype), by numpy: one thread, GIL released. In the disk
    tier's reader threads torch's copy_ starts an OpenMP team per thread, oversubscribing the cores: measured
    3x slower in all than this (86 against 25 ms for the 250 blocks of an 8K-token prefix, 2 reader threads).
    The integer view makes any float dtype (bfloat16 too, which numpy lacks) a plain copy."""
    as_int = _SAME_SIZE_INT[src.element_size()]
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())


class Assembler:
    """Carries plans out for one model and store: the steps of the module docstring. The engine owns one, and
    hands it the `Planner` whose keys and prefix index it shares."""

    def __init__(self, runner: LlamaRunner, store: Store, planner: Planner):
        self.runner = runner
        self.store = store
        self.planner = planner
        # Extents this process wrote or read, so a request whose blocks memory holds singly (all hits) does not
        # write the extent again; one it does not know of is written (a chat that grew past a group, say).
        self.extents_stored: OrderedDict[str, None] = OrderedDict()
        self._extents_lock = threading.Lock()  # requests of a server's batch plan and store concurrently
        self.scaffold_bytes = 0  # what joint encodings cost on top of the chunks' own blocks
        # What encoding chunks cost, by where it ran: on a request's path, after a reply, elsewhere (warm, scaffolds).
        self.encodes = {where: EncodeCounts() for where in ("request", "after_reply", "other")}

    def lookups(self) -> StoreLookups:
        """The store as a request's planning asks it; its `blocks` are what `assemble` then builds from (blocks on
        disk or in Redis are left unread, to be read straight into the request buffer: `_read`)."""
        return StoreLookups(self.store, self.place)

    def place(self, block: KVBlock | None) -> KVBlock | None:
        """The block on the model's device. Blocks read from disk or Redis are CPU tensors; the engine hands
        this to a TieredStore to place them once, before promotion, and lookups catch any other store."""
        if block is None or block.keys.device == self.runner.device:
            return block
        keys, values = self.runner.place(block.keys, block.values)
        return KVBlock(keys, values, block.token_ids, block.start, block.meta)

    def _get(self, key: str) -> tuple[KVBlock | None, str | None]:
        block, origin = self.store.get_with_source(key)
        return self.place(block), origin

    # ---- encode ------------------------------------------------------------------------------------------------
    def encode_chunk(self, token_ids: tuple[int, ...], start: int, kind: str = "chunk") -> KVBlock:
        """Encode a chunk (or a scaffold group) on its own: sink tokens at 0.., its first token at `start`."""
        return self.encode_chunks([(token_ids, start, kind)], "other")[0]

    @torch.inference_mode()
    def encode_chunks(self, chunks: Sequence[tuple[tuple[int, ...], int, str]], where: str) -> list[KVBlock]:
        """Encode chunks (token ids, encode position, kind) each on its own, after the sink tokens at 0.., its first
        token at its position, in one batched pass (`LlamaRunner.encode_apart`: a block-diagonal prefill, each
        chunk seeing the sink and itself): what every piece a request encodes costs together is about one prefill
        of their tokens, not a forward each. Counted in `encodes[where]` ("request", "after_reply", "other")."""
        if not chunks:
            return []
        sink_ids = list(self.planner.sink_ids)
        n_sink = len(sink_ids)
        caches, forwards = self.runner.encode_apart(
            [sink_ids + list(ids) for ids, _, _ in chunks],
            [list(range(n_sink)) + list(range(start, start + len(ids))) for ids, start, _ in chunks])
        blocks = []
        for cache, (ids, start, kind) in zip(caches, chunks, strict=True):
            k, v = cache.block_views(n_sink, n_sink + len(ids))
            blocks.append(KVBlock(k.clone(), v.clone(), tuple(ids), start, {"kind": kind}))
        self.encodes[where].add(forwards, len(chunks), sum(len(ids) for ids, _, _ in chunks))
        return blocks

    def _store_encoded(self, key: str, block: KVBlock) -> KVBlock:
        self.store.put(key, block)
        if block.meta.get("kind") == "scaffold":
            self.scaffold_bytes += block.nbytes
        return block

    def _encode_and_store(self, key: str, token_ids: tuple[int, ...], start: int, source: str,
                          where: str = "request") -> KVBlock:
        return self._store_encoded(key, self.encode_chunks([(token_ids, start, source)], where)[0])

    def ensure_stored(self, want: Wanted) -> str:
        """The block of `want` in the store, encoded and stored now if no tier holds it (`Engine.warm`, the
        background scaffold builder); returns its origin ("computed" when encoded now)."""
        block, origin = self._get(want.key)
        if block is None or block.token_ids != want.token_ids:
            self._encode_and_store(want.key, want.token_ids, want.start, want.source, "other")
            return COMPUTED
        return origin

    def store_missing(self, wants: Sequence[Wanted], where: str) -> int:
        """The blocks of `wants` no tier holds (`Store.contains`: nothing is read), encoded in one batched pass
        (`encode_chunks`) and stored; returns how many were encoded."""
        missing = [w for w in {w.key: w for w in wants}.values() if not self.store.contains(w.key)]
        blocks = self.encode_chunks([(w.token_ids, w.start, w.source) for w in missing], where)
        for w, block in zip(missing, blocks, strict=True):
            self._store_encoded(w.key, block)
        return len(missing)

    def _encode(self, plan: Plan,
                blocks: Mapping[str, KVBlock | PendingBlock]) -> tuple[list[Event], dict[int, KVBlock]]:
        """Step 1: the blocks to copy in, by slot: those in hand, and the misses ("encode") encoded now, all in one
        batched pass (`encode_chunks`), and stored.
        Each encoded block is read back from the store right away, and a later piece of the same block ("stored":
        the separator between chunks) uses what the store gave, as a later request would (a memory hit, reused);
        should the store not give it back, that piece encodes it again (an event: "not kept")."""
        in_hand: dict[int, KVBlock] = {}
        got: dict[str, KVBlock | None] = {}
        events: list[Event] = []
        misses = [p for p in plan.pieces if p.load == Load.ENCODE]  # one key each (planning encodes a key once)
        encoded = self.encode_chunks([(plan.ids[p.slot: p.slot + p.n], p.encode_start, p.source) for p in misses],
                                     "request")
        for p, block in zip(misses, encoded, strict=True):
            in_hand[p.slot] = self._store_encoded(p.key, block)
            got[p.key] = self._get(p.key)[0]
        for p in plan.pieces:
            if p.load == Load.COPY:
                in_hand[p.slot] = blocks[p.key]
                continue
            if p.load != Load.STORED:
                continue
            ids = plan.ids[p.slot: p.slot + p.n]
            block = got[p.key]
            if block is not None and block.token_ids == ids:
                in_hand[p.slot] = block
                continue
            events.append(Event(p.slot, "not kept", replace(p, origin=COMPUTED, load=Load.ENCODE)))
            in_hand[p.slot] = self._encode_and_store(p.key, ids, p.encode_start, p.source)
            got[p.key] = self._get(p.key)[0]
        return events, in_hand

    # ---- build and forward -------------------------------------------------------------------------------------
    def assemble(self, plan: Plan, blocks: Mapping[str, KVBlock | PendingBlock], extra_capacity: int,
                 recompute: Recompute | None = None, defer: int = 0) -> Assembled:
        """Carries `plan` out with the `blocks` its lookups found (`lookups().blocks`): encode, build, forward.
        `defer`: where the tokens to compute are the prompt's last ones, at most this many, leave them (logits
        None, `deferred` their count, the cache that many slots short) to the caller, whose batched decode step
        computes them with other requests' tokens."""
        self._index(plan)
        events, in_hand = self._encode(plan, blocks)
        ids, positions = plan.ids, plan.positions
        total = len(ids)
        # Blocks a pooled buffer may still hold in place from its last request (model/cache.py): those found
        # there are neither read nor copied again (a system text or conversation sent again: 2K tokens of fp32
        # KV were 22% of such a request's time to first token, bench model).
        changed = {e.slot for e in events}
        # APE's attention reads every slot from one buffer (model/aligned.py): no shared prefix read in place
        lead, whole = self._shared_lead(plan, changed, recompute) if plan.align is None else ([], 0)
        base = self.runner.take_shared_prefix(
            tuple(_held(p) for p in lead), whole,
            lambda keys, values: self._build_shared(lead[:whole], in_hand, keys, values)) if lead else None
        if base is not None:  # read in place from one copy every request over this prefix shares (model/cache.py)
            try:
                cache = self.runner.acquire_cache(total + extra_capacity - base.n)
            except BaseException:
                self.runner.let_go(base)
                raise
            cache.attach(base)
            present = {p.slot for p in lead if p.slot + p.n <= base.n}  # the rest of the lead is copied in
        else:
            wanted = [_held(p) for p in plan.pieces if p.load in (Load.COPY, Load.READ, Load.STORED)
                      and p.slot not in changed]
            cache = self.runner.acquire_cache(total + extra_capacity, wanted)
            present = {b.slot for b in wanted if cache.holds(b.key, b.slot, b.n, b.position)}
            cache.hold(tuple(b for b in wanted if b.slot in present))  # until the copies below are all in
        plan = plan.with_events(events + self._read(plan, blocks, cache, in_hand, present))
        pieces = plan.as_built().pieces
        fresh, cached = self._copy_in(pieces, cache, in_hand, present)
        # Slots already hold the cached blocks; cache.length must cover them before any forward, whose writes
        # (runner.py) then mark where the blocks recorded here stop being intact.
        cache.length = total
        if not cache.base:  # a buffer after a shared prefix holds its slots shifted: it offers nothing in place later
            cache.hold(tuple(_held(p) for p in pieces if p.load in (Load.COPY, Load.READ, Load.ENCODE, Load.STORED)))
        # APE (align.py): the reused chunks' slots, which the tokens computed after them attend to aligned
        cache.align = None if plan.align is None else Aligned.of(
            plan.align, aligned_slots(pieces), cache.own_capacity, self.runner.shape.num_layers, cache.keys.device)
        if total - 1 not in fresh:
            # The prompt ends inside a cached block: recompute its last token so we have its logits.
            fresh.add(total - 1)
            if self._reused(pieces, total - 1):
                cached -= 1
        deferred, deviation = 0, None
        if (defer and len(fresh) <= defer and min(fresh) == total - len(fresh)
                and (recompute is None or recompute.ratio == 0)):
            deferred = len(fresh)  # a contiguous tail: the slots before it are all filled
            cache.length = total - deferred
            logits, recomputed = None, set()
        else:
            logits, recomputed, deviation = self._forward(pieces, cache, ids, positions, fresh, recompute)
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
            read={p.key: blocks[p.key] for p in pieces if p.load == Load.READ},
            deferred=deferred,
            deviation=deviation,
        )

    def _shared_lead(self, plan: Plan, changed: set[int], recompute: Recompute | None) -> tuple[list[Piece], int]:
        """The prompt's first pieces that a shared prefix may hold (read in place, not copied): the exact prefix
        blocks in memory from slot 0 on, ending before the prompt's last token (whose logits the forward computes);
        and how many of them a new shared prefix takes: up to the last whole block (the next prompt may part from
        this one inside a block), at least `runner.shared_prefix_min_tokens` tokens, else none at all.

        A new shared prefix is built only while other requests run (`whole` 0 otherwise): a request alone reads
        one built earlier, if any, and else copies its prefix as before (a pooled buffer may hold it in place
        already, and one attention over its buffer is one call of the prefill kernel, not two merged). None in
        blend (it recomputes reused slots in place) or where the runner's layers cannot attend over a shared prefix
        (sliding windows, soft-capping)."""
        if (recompute is not None and (recompute.ratio > 0 or recompute.target is not None)) or \
                not self.runner.shares_prefixes:
            return [], 0
        lead, end = [], 0
        for p in plan.pieces:
            if (p.source != Source.PREFIX or p.load != Load.COPY or p.members or p.slot != end or p.slot in changed
                    or p.slot + p.n > len(plan.ids) - 1):
                break
            lead.append(p)
            end += p.n
        whole = len(lead)
        while whole and lead[whole - 1].n < self.planner.block_tokens:
            whole -= 1
        if sum(p.n for p in lead[:whole]) < self.runner.shared_prefix_min_tokens:
            return [], 0
        return lead, whole if self.runner.others_decoding() else 0

    def _build_shared(self, lead: Sequence[Piece], in_hand: Mapping[int, KVBlock], keys: torch.Tensor,
                      values: torch.Tensor) -> None:
        """A new shared prefix's slots [0, n) ([L, 1, H_kv, n, D] each), from the lead pieces' blocks."""
        for p in lead:
            block = in_hand[p.slot]
            k, v = block.keys[:, :, : p.n], block.values[:, :, : p.n]
            self.runner.relocate(keys[:, 0, :, p.slot: p.slot + p.n], k, p.position - block.start)
            values[:, 0, :, p.slot: p.slot + p.n].copy_(v)

    def _copy_in(self, pieces: Sequence[Piece], cache: SlotCache, in_hand: Mapping[int, KVBlock],
                 present: set[int]) -> tuple[set[int], int]:
        """Step 2, build: every reused block not already in its slots (read there, or held from the buffer's last
        request) copied in, relocated blocks' keys rotated to their positions. Returns the fresh slots (for the
        forward) and the tokens reused from the store."""
        fresh: set[int] = set()
        cached = 0
        for p in pieces:
            if p.source == Source.FRESH:
                fresh.update(range(p.slot, p.slot + p.n))
                continue
            if p.load == Load.READ or (p.slot in present and p.load in (Load.COPY, Load.STORED)):  # in its slots
                cached += p.n
                continue
            block = in_hand[p.slot]
            keys, values = block.keys, block.values
            if p.n != keys.shape[2]:  # a prefix block shared up to its n-th token
                keys, values = keys[:, :, : p.n], values[:, :, : p.n]
            dk, dv = cache.block_views(p.slot, p.slot + p.n)
            self.runner.relocate(dk, keys, p.position - block.start)
            dv.copy_(values)
            if p.origin != COMPUTED:  # encoded by this very request: computed, not reused
                cached += p.n
        return fresh, cached

    def _forward(self, pieces, cache: SlotCache, ids, positions, fresh: set[int],
                 recompute: Recompute | None) -> tuple[torch.Tensor, set[int], float | None]:
        """Step 3: one forward over the fresh slots (and, in blend, a share of the reused chunk tokens); returns the
        logits, the chunk slots recomputed and blend's measured deviation."""
        if recompute is not None and (recompute.ratio > 0 or recompute.target is not None):
            return self._blend(pieces, cache, ids, positions, fresh, recompute)
        order = sorted(fresh)
        logits = self.runner.forward(cache, [ids[s] for s in order], [positions[s] for s in order], order)
        return logits, set(), None

    def _index(self, plan: Plan) -> None:
        """The prefix blocks the plan found, into the prefix index (and the partial matches it used, marked used),
        so that a later prompt leaving this one inside a block still finds their first tokens."""
        prefixes = self.planner.prefixes
        for ref in plan.found_blocks:
            prefixes.add(ref.parent, ref.key, plan.ids[ref.start: ref.end], plan.positions[ref.start: ref.end])
        for p in plan.pieces:
            if p.source == Source.PREFIX and not p.members:
                prefixes.touch(p.key)

    def _read(self, plan: Plan, blocks: Mapping[str, KVBlock | PendingBlock], cache: SlotCache,
              in_hand: dict[int, KVBlock], present: set[int] = frozenset()) -> list[Event]:
        """Reads the plan's "read" blocks (found on disk or in Redis at planning) straight into their slots of
        `cache`, in the tiers' reader threads: a bit-exact block is read from its file into the slots and checked
        there, any other through a reused staging buffer and copied in; no block gets memory of its own, so a
        request from disk faults in no fresh pages (they cost more than the reads). Relocated blocks' keys are then
        rotated in place to their positions here. The memory tier gets these blocks after the reply
        (`save_prefix`). A block that cannot be used (gone, corrupt, unreadable since planning, or holding other
        tokens): an event ("lost") says what replaced it: for a prefix block, the forward computes its slots; for a
        relocated block, the block encoded now and stored, as a miss would be (into `in_hand`)."""
        pending = [p for p in plan.pieces if p.load == Load.READ]
        # A block already in every slot it goes to (`present`) is not read; one that is missing from any of them is
        # read as usual (its other pieces copy from the first).
        missing = {p.key for p in pending if p.slot not in present}
        pending = [p for p in pending if p.key in missing]
        if not pending:
            return []
        # A block used more than once (the separator between chunks) is read once, into its first piece's slots,
        # and copied from there into the others' before any rotation (from the position its keys are at there).
        first: dict[str, Piece] = {}
        for p in pending:
            first.setdefault(p.key, p)
        rotations: list[tuple[torch.Tensor, int]] = []
        starts: dict[str, int] = {}
        reads = list(first.values())
        read = self.store.read_pending([blocks[p.key] for p in reads],
                                       [self._read_target(p, plan.ids, cache, rotations, starts) for p in reads])
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
        lost = [p for p in pending if p.key not in ok]
        for p in lost:
            if p.members:  # gone or damaged: written again after the reply
                with self._extents_lock:
                    self.extents_stored.pop(p.key, None)
        return [Event(p.slot, "lost", self._recover(p, plan.ids, in_hand) if p.relocated
                      else Piece(p.slot, p.n, Source.FRESH, p.kind, p.position)) for p in lost]

    def _recover(self, p: Piece, ids: tuple[int, ...], in_hand: dict[int, KVBlock]) -> Piece:
        """A relocated block that could not be read, as for a miss: encoded now and stored, or found in memory when
        a piece of the same block was just recovered; its block goes into `in_hand` for the copy."""
        want = ids[p.slot: p.slot + p.n]
        block, origin = self._get(p.key)
        if block is None or block.token_ids != want:
            block, origin = self._encode_and_store(p.key, want, p.encode_start, p.source), COMPUTED
        in_hand[p.slot] = block
        return replace(p, origin=origin, load=Load.ENCODE if origin == COMPUTED else Load.COPY)

    def _read_target(self, p: Piece, ids: tuple[int, ...], cache: SlotCache,
                     rotations: list[tuple[torch.Tensor, int]], starts: dict[str, int]) -> ReadTarget:
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

        return ReadTarget(take, dk, dv)

    @staticmethod
    def _reused(pieces: Sequence[Piece], slot: int) -> bool:
        for p in pieces:
            if p.slot <= slot < p.slot + p.n:
                return p.source != Source.FRESH and p.origin != COMPUTED
        return False

    def _blend(self, pieces, cache: SlotCache, ids, positions, fresh: set[int],
               recompute: Recompute) -> tuple[torch.Tensor, set[int], float | None]:
        """Blend's forward: the fresh slots plus a share of the relocated chunk tokens (`recompute.ratio`, or as many
        as `recompute.target` asks), chosen by `recompute.select`. Returns the last token's logits, the chunk slots
        whose KV was recomputed (in the last layer) and the mean relative key deviation the probe measured."""
        spans = [[s for s in range(p.slot, p.slot + p.n) if s not in fresh]
                 for p in pieces if p.source in (Source.CHUNK, Source.SCAFFOLD)]
        spans = [span for span in spans if span]
        candidates = sorted(s for span in spans for s in span)
        k = round(recompute.ratio * len(candidates))
        runner = self.runner
        auto = recompute.target is not None and bool(candidates)

        def run(chosen: set[int]) -> tuple[torch.Tensor, set[int], None]:
            order = sorted(fresh | chosen)
            return runner.forward(cache, [ids[s] for s in order], [positions[s] for s in order], order), chosen, None

        if not auto and k == 0:
            return run(set())
        if not auto and recompute.select == "chunk_start":
            return run(set(first_tokens(spans, k)))
        layers = runner.shape.num_layers
        probed = None  # the mean relative shift, where a target was read from the cheap probe
        if recompute.select == "shift":
            relative = None
            if auto:
                # The target read from the cheap probe instead of layer 1: how far layer 0 moves each candidate in
                # context (relative, against the model's reference shift) says how many tokens to recompute, and
                # the most moved are what layer 0 computes; from there the fixed "shift" schedule for that many.
                relative = self._shift(pieces, ids, positions, candidates, relative=True)
                # Target 1 takes them all: a token whose layer-0 attention sits on one key moves by exactly 0 there
                # and still moves deeper (seen on the retrieval testbed), which this probe cannot see.
                k = len(candidates) if recompute.target >= 1.0 else target_tokens(relative, recompute)
                probed, auto = float(relative.mean()), False
                if k == 0:
                    logits, chosen, _ = run(set())
                    return logits, chosen, probed
            width = tokens_per_layer("shift", k, len(candidates), layers)[0]
            candidates = self._most_shifted(pieces, ids, positions, candidates, width, relative)
        # Key deviation (CacheBlend): every candidate runs layer 0 in context (layer 0's keys never see context,
        # so layer 1 is the first whose keys can show what the chunk missed); from layer 1 on, the candidates
        # whose fresh keys moved least from their cached ones are dropped and keep their cached KV.
        # A target keeps every candidate until layer 1 has measured how far they deviate.
        schedule = [len(candidates)] * layers if auto else tokens_per_layer(recompute.select, k, len(candidates),
                                                                            layers)
        cand = torch.tensor(candidates, device=cache.keys.device)
        kept: list[torch.Tensor] = []
        measured: list[float] = []

        def narrow(layer: int, slots: torch.Tensor, keys: torch.Tensor):
            is_cand = torch.isin(slots, cand)
            cached = cache.keys[layer, 0][:, slots].float()
            moved = (keys.float() - cached).norm(dim=-1).sum(0)  # [rows]
            if layer == 1 and not measured:
                relative = moved / keys.float().norm(dim=-1).sum(0).clamp_min(1e-12)
                measured.append(float(relative[is_cand].mean()))
                if auto:
                    schedule[:] = tokens_per_layer("progressive", target_tokens(relative[is_cand], recompute),
                                                   len(candidates), layers)
            n = schedule[layer]
            if n >= int(is_cand.sum()):
                return None
            moved = torch.where(is_cand, moved, torch.inf)  # fresh tokens always stay
            keep = torch.topk(moved, n + int((~is_cand).sum())).indices.sort().values
            kept[:] = [slots[keep]]
            return keep

        order = sorted(fresh | set(candidates))
        logits = runner.forward_layers(cache, [ids[s] for s in order], [positions[s] for s in order], order,
                                       narrow=narrow)
        final = set(kept[0].tolist()) if kept else set(order)
        return logits, final & set(candidates), (probed if probed is not None else measured[0] if measured else None)

    def _most_shifted(self, pieces, ids, positions, candidates: list[int], n: int,
                      shift: torch.Tensor | None = None) -> list[int]:
        """The `n` candidate slots whose layer-0 attention output moves most in context (`context_shift`, unless
        `shift` already holds a measure of it per candidate)."""
        if n >= len(candidates):
            return candidates
        if shift is None:
            shift = self._shift(pieces, ids, positions, candidates)
        return sorted(candidates[i] for i in torch.topk(shift, n).indices.tolist())

    def _shift(self, pieces, ids, positions, candidates: list[int], relative: bool = False) -> torch.Tensor:
        """`runner.context_shift` of the candidate slots, each against the block it was encoded in."""
        block: dict[int, Piece] = {}
        for p in pieces:
            if p.source in (Source.CHUNK, Source.SCAFFOLD):
                block.update(dict.fromkeys(range(p.slot, p.slot + p.n), p))
        return self.runner.context_shift(ids, positions, candidates,
                                         [(block[s].slot, block[s].position - block[s].encode_start)
                                          for s in candidates], self.planner.sink_ids, relative)

    def save_prefix(self, assembled: Assembled, generated: Sequence[int] = (),
                    skip: frozenset[str] = frozenset()) -> frozenset[str]:
        """Store the prefix blocks this request computed, once the reply is out: every block of the plan's
        layout that was not reused whole, the forwarded reply tokens (`generated`, whose KV follows the
        prompt's in the cache) included. Whole blocks and blocks of closed runs go to every tier; the short
        tail of the last run only to memory, since only this process's index can find it. Blocks read from
        disk straight into the request buffer (`_read`) are put into memory here rather than on the
        request path (their copy is fresh memory to fault in), so the next request finds them there: prefix
        blocks copied from the buffer, relocated blocks (whose keys the buffer holds rotated) read again, from
        the page cache by then. Returns the keys written; `skip`: keys an earlier call for this request already
        wrote."""
        plan = assembled.plan.as_built()
        relocated = [assembled.read[p.key] for p in plan.pieces if p.load == Load.READ and p.relocated
                     and p.key not in skip]
        if relocated:
            self.store.promote(relocated)  # pending blocks come from a TieredStore (find_many_with_source)
        written: set[str] = {p.key for p in relocated}
        if not plan.layout:
            return frozenset(written)
        direct = {k for p in plan.pieces if p.load == Load.READ and not p.relocated for k in p.block_keys}
        grouped = self.store.has_persistent
        planner = self.planner
        block_tokens = planner.block_tokens
        total = assembled.prompt_tokens
        ids = plan.ids + tuple(generated)
        positions = plan.positions + tuple(range(assembled.last_position + 1, assembled.last_position + 1
                                                 + len(generated)))
        last = plan.layout[-1]
        replied = isinstance(last, Run) and last.end == total  # the reply continues the layout's last run
        stored: list[HeldBlock] = []  # what the buffer now holds as blocks too: the next turn copies none of it
        parent = planner.root_for(plan.namespace)
        for item in plan.layout:
            if isinstance(item, Link):
                parent = after_link(parent, item)
                continue
            end = len(ids) if item is last and replied else item.end
            refs = run_blocks(planner.fingerprint, parent, ids, positions, item.start, end, True, block_tokens)
            groups = far_groups(refs, extents(refs, block_tokens), total, block_tokens) if grouped else []
            in_group = in_groups(groups)
            for j, ref in enumerate(refs):
                parent = ref.key
                if (ref.key in plan.hits and ref.key not in direct) or ref.key in skip:
                    continue
                k, v = assembled.cache.read(ref.start, ref.end)
                block = KVBlock(k.clone(), v.clone(), ids[ref.start: ref.end], positions[ref.start],
                                {"kind": "prefix"})
                whole = ref.end - ref.start == block_tokens or item.closed
                persist = whole and ref.key not in direct and j not in in_group  # else in its extent only
                if persist:
                    self.store.put(ref.key, block)
                else:
                    self.store.put_volatile(ref.key, block)
                planner.prefixes.add(ref.parent, ref.key, block.token_ids, positions[ref.start: ref.end])
                written.add(ref.key)
                stored.append(HeldBlock(ref.key, ref.start, ref.end - ref.start, positions[ref.start]))
            written |= self._save_extents(assembled.cache, refs, groups, ids, positions, plan.hits | skip)
        assembled.cache.hold(assembled.cache.held + tuple(stored))
        return frozenset(written)

    def _save_extents(self, cache: SlotCache, refs, groups: list[tuple[int, str]], ids, positions,
                      known: frozenset[str]) -> set[str]:
        """A run's whole groups of blocks, each as one extent in the persistent tiers (prefix.py), unless it was
        read (then only noted) or written already; returns the keys written."""
        written = set()
        for i, key in groups:
            if key in known:  # read from it, or written by this request already
                self._note_extent(key)
                continue
            if key in self.extents_stored:
                continue
            a, b = refs[i].start, refs[i + EXTENT_BLOCKS - 1].end
            k, v = cache.read(a, b)
            self.store.put_persistent(key, KVBlock(k.clone(), v.clone(), ids[a:b], positions[a], {"kind": "prefix"}))
            self._note_extent(key)
            written.add(key)
        return written

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
# 3x 89% / 89%, 5x 93% / 97%, at a growing cost. docs/results.md ("Blend") has the tables.
PROGRESSIVE_START = 3


def tokens_per_layer(select: str, k: int, candidates: int, layers: int) -> list[int]:
    """How many of the `candidates` relocated chunk tokens each layer computes in context, for a final budget of
    `k` tokens. "chunk_start": the same k in every layer. "deviation": all of them in layer 0 (the
    probe that measures deviation at layer 1), then k. "progressive" (CacheBlend's gradual filtering): all in
    layer 0, then PROGRESSIVE_START * k at layer 1, k fewer at each next layer down to k, and k in the last layer."""
    if select == "chunk_start" or k == 0:
        return [k] * layers
    if select == "deviation":
        return [candidates] + [k] * (layers - 1)
    if select == "shift":  # layer 0 computes only what the cheap probe picked: layer 1's share
        return [min(candidates, PROGRESSIVE_START * k)] + tokens_per_layer("progressive", k, candidates, layers)[1:]
    return [candidates] + [k if i == layers - 1 else min(candidates, max(1, PROGRESSIVE_START + 1 - i) * k)
                           for i in range(1, layers)]


def target_tokens(relative: torch.Tensor, recompute: Recompute) -> int:
    """How many of the candidates (their relative key deviations at layer 1) a quality target recomputes: the
    fewest, taken from the most deviating, for the deviation left to be at most (1 - target) of this prompt's own,
    or of the model's reference when the prompt deviates less than that (`Recompute.target`)."""
    relative = relative.double()  # the sum and the running sum must agree at target 0 (float32 rounding does not)
    allowed = (1.0 - recompute.target) * max(recompute.reference * len(relative), float(relative.sum()))
    left = torch.sort(relative).values.cumsum(0)  # what stays if only the i+1 smallest are kept cached
    return len(relative) - int((left <= allowed * (1 + 1e-9) + 1e-12).sum())


def recompute_work(select: str, ratio: float, candidates: int, layers: int, probe: float = 0.0,
                   target: bool = False) -> float:
    """The share of a full recompute of the chunk tokens (token-layers) that blend at `ratio` computes; "shift"
    adds its probe over every candidate, `probe` of a layer each (`LlamaRunner.shift_probe_share`): always where a
    target was read from it (`target`, the ratio then being what the target chose), else only where it picked."""
    if not candidates:
        return 0.0
    k = round(ratio * candidates)
    # a fixed ratio runs the probe only where it picks fewer than all (else every candidate runs layer 0)
    probed = select == "shift" and (target or 0 < PROGRESSIVE_START * k < candidates)
    extra = probe * candidates if probed else 0.0
    return (sum(tokens_per_layer(select, k, candidates, layers)) + extra) / (candidates * layers)


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
