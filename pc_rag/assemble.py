"""From token segments to an assembled cache and the prompt's last logits.

A plan says, for every segment of the prompt, where its KV comes from:
- "prefix":   an exact-prefix trie node (KV computed after exactly this prefix: identical to full prefill);
- "chunk":    a chunk encoded on its own after the sink prefix, RoPE-relocated to its place (approximation:
              it never saw the segments before it);
- "scaffold": a declared group of chunks (with the text between them) encoded jointly, relocated as one
              block: exact inside the group, an approximation with respect to what precedes it;
- "fresh":    computed in this request's single forward pass, attending to everything before it.
Planning is plain Python over the store; `assemble` then copies blocks into the request's slots and runs
one forward for all fresh tokens, plus, in `blend` mode, a chosen fraction of the reused chunk tokens,
recomputed with the whole prompt as context (their cached KV is overwritten).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .blocks import KVBlock, chunk_key, prefix_key, scaffold_key
from .errors import PCRagError, PromptError, UnsupportedModelError
from .model import LlamaRunner, SlotCache
from .segments import TokenSegment
from .store import get_with_source

MODES = ("full", "exact", "modular", "blend")
REUSING_CHUNKS = ("modular", "blend")
SELECTIONS = ("deviation", "chunk_start")


@dataclass(frozen=True)
class Piece:
    segment: TokenSegment  # for a scaffold: the group's segments merged into one
    slot: int  # first slot (= index of its first token in the prompt)
    source: str  # "fresh" | "prefix" | "chunk" | "scaffold"
    key: str | None = None  # store key it came from or will be saved under
    block: KVBlock | None = None
    origin: str | None = None  # store tier (or "computed" for a block encoded by this request)


@dataclass(frozen=True)
class Recompute:
    """Blend: which reused chunk tokens are recomputed with the whole prompt as context.

    ratio:  fraction of the relocated chunk tokens recomputed (0 = modular, 1 = full).
    select: "deviation" (CacheBlend) computes the keys of layer `probe_layer` with the whole prompt as
            context and picks the tokens whose keys moved most from the cached ones; "chunk_start" takes the
            first tokens of every chunk (attention-sink repair: no probe, cheaper).
    probe_layer: layer 0's keys never see context (they equal the cached ones after relocation), so the
            first layer whose keys can deviate is 1, and its probe costs one layer plus a projection.
    """

    ratio: float
    select: str = "deviation"
    probe_layer: int = 1

    def __post_init__(self):
        if not 0.0 <= self.ratio <= 1.0:
            raise PCRagError(f"recompute_ratio must be in [0, 1], got {self.ratio}")
        if self.select not in SELECTIONS:
            raise PCRagError(f"unknown blend selection {self.select!r}; choose one of {', '.join(SELECTIONS)}")


@dataclass(frozen=True)
class Assembled:
    cache: SlotCache
    logits: torch.Tensor  # [vocab] fp32, next-token logits after the prompt
    pieces: tuple[Piece, ...]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    recomputed_tokens: int  # reused chunk tokens recomputed by blend (counted in computed_tokens)
    last_position: int


class Assembler:
    """Plans and builds the cache for one prompt, in one of MODES."""

    def __init__(self, runner: LlamaRunner, store, sink_ids: tuple[int, ...]):
        self.runner = runner
        self.store = store
        self.sink_ids = sink_ids  # what every chunk is encoded after (BOS when the tokenizer has one)
        self.root = "root-" + runner.fingerprint
        # Declared scaffold groups, by their first chunk's tokens: each a tuple of chunk token tuples.
        self.scaffolds: dict[tuple[int, ...], set[tuple[tuple[int, ...], ...]]] = {}
        self.scaffold_bytes = 0  # what joint encodings cost on top of the chunks' own blocks
        self.reuse_separators = True  # whitespace-only text after a chunk is reused like a chunk (see plan)

    def add_scaffold(self, chunks: Sequence[tuple[int, ...]]) -> None:
        if len(chunks) < 2:
            raise PCRagError("a scaffold groups at least two chunks")
        self.scaffolds.setdefault(chunks[0], set()).add(tuple(chunks))

    # ---- planning -------------------------------------------------------------------------------------
    def plan(self, segments: list[TokenSegment], mode: str) -> list[Piece]:
        if mode not in MODES:
            raise PromptError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode in REUSING_CHUNKS and not self.runner.relocatable:
            raise UnsupportedModelError(
                f"rope_type {self.runner.rope_type!r} rescales with sequence length, so relocating cached keys "
                f"by rotation is not exact; use mode='exact' or mode='full' with this model"
            )
        slots, s = [], 0
        for seg in segments:
            slots.append(s)
            s += len(seg)
        pieces: list[Piece] = []
        parent, i = self.root, 0
        if mode != "full":
            # Longest cached exact prefix, segment by segment; the last segment is always computed so the
            # prompt's last token has fresh logits.
            while i < len(segments) - 1:
                key = prefix_key(self.runner.fingerprint, parent, segments[i].token_ids, segments[i].start)
                block, origin = get_with_source(self.store, key)
                if block is None or block.token_ids != segments[i].token_ids:
                    break
                pieces.append(Piece(segments[i], slots[i], "prefix", key, block, origin))
                parent, i = key, i + 1
        j = i
        while j < len(segments):
            seg = segments[j]
            if mode in REUSING_CHUNKS and seg.kind == "chunk":
                end = self._scaffold_end(segments, j)
                if end is not None:
                    pieces.append(self.scaffold_piece(segments[j:end], slots[j]))
                    j = end
                    continue
                pieces.append(self.chunk_piece(seg, slots[j]))
            elif mode in REUSING_CHUNKS and seg.kind == "sep" and self.reuse_separators and j < len(segments) - 1 \
                    and pieces[-1:] and pieces[-1].source in ("chunk", "scaffold"):
                # Whitespace between chunks ("\n\n" in every RAG template) is reused like a chunk: computing
                # it fresh cost as much as a question of the same length per separator (measured: 14 of the
                # 41 fresh tokens at 4K tokens, +15% TTFT); its KV barely depends on context (see fidelity).
                pieces.append(self.chunk_piece(seg, slots[j]))
            else:
                key = None
                # Only segments before the first relocated block have exact KV worth a trie node.
                exact_so_far = all(p.source in ("prefix", "fresh") for p in pieces)
                if mode != "full" and j < len(segments) - 1 and exact_so_far:
                    key = prefix_key(self.runner.fingerprint, parent, seg.token_ids, seg.start)
                    parent = key
                pieces.append(Piece(seg, slots[j], "fresh", key))
            j += 1
        return pieces

    def _lookup_or_encode(self, key: str, token_ids: tuple[int, ...], start: int, kind: str):
        block, origin = get_with_source(self.store, key)
        if block is not None and block.token_ids != token_ids:
            block = None  # a key collision or a foreign entry: never use KV for other tokens
        if block is None:
            block, origin = self.encode_chunk(token_ids, start, kind), "computed"
            self.store.put(key, block)
            if kind == "scaffold":
                self.scaffold_bytes += block.nbytes
        return block, origin

    def chunk_piece(self, seg: TokenSegment, slot: int) -> Piece:
        """A chunk's own block (encoded after the sink, at its encode position), from the store or encoded now."""
        start = seg.encode_start if seg.encode_start is not None else len(self.sink_ids)
        key = chunk_key(self.runner.fingerprint, seg.token_ids, self.sink_ids, start)
        block, origin = self._lookup_or_encode(key, seg.token_ids, start, "chunk")
        return Piece(seg, slot, "chunk", key, block, origin)

    def _scaffold_end(self, segments: list[TokenSegment], j: int) -> int | None:
        """End index of a declared scaffold group starting at segment j (its chunks in order, separated
        only by text, at consecutive positions), or None."""
        groups = self.scaffolds.get(segments[j].token_ids)
        if not groups:
            return None
        best = None
        for group in tuple(groups):  # a copy: the background scaffold builder may add groups meanwhile
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

    def scaffold_piece(self, span: list[TokenSegment], slot: int) -> Piece:
        """The joint block of `span` (chunks and the text between them), from the store or encoded now."""
        ids = tuple(t for s in span for t in s.token_ids)
        merged = TokenSegment("scaffold", ids, span[0].start)
        start = len(self.sink_ids)
        key = scaffold_key(self.runner.fingerprint, [s.token_ids for s in span], self.sink_ids, start)
        block, origin = self._lookup_or_encode(key, ids, start, "scaffold")
        return Piece(merged, slot, "scaffold", key, block, origin)

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
    def assemble(self, pieces: list[Piece], extra_capacity: int, recompute: Recompute | None = None) -> Assembled:
        total = pieces[-1].slot + len(pieces[-1].segment)
        cache = self.runner.acquire_cache(total + extra_capacity)
        ids = [t for p in pieces for t in p.segment.token_ids]  # by slot
        positions = [q for p in pieces for q in range(p.segment.start, p.segment.end)]
        fresh: set[int] = set()
        cached = 0
        for p in pieces:
            seg, n = p.segment, len(p.segment)
            if p.source == "fresh":
                fresh.update(range(p.slot, p.slot + n))
                continue
            dk, dv = cache.block_views(p.slot, p.slot + n)
            self.runner.relocate(dk, p.block.keys, seg.start - p.block.start)
            dv.copy_(p.block.values)
            if p.origin != "computed":  # encoded by this very request: computed, not reused
                cached += n
        # Slots already hold the cached blocks; cache.length must cover them before any forward.
        cache.length = total
        recomputed = self._select(pieces, cache, ids, positions, recompute) if recompute else set()
        reused_recomputed = sum(1 for s in recomputed if self._reused(pieces, s))
        cached -= reused_recomputed
        fresh |= recomputed
        if total - 1 not in fresh:
            # The prompt ends inside a cached block: recompute its last token so we have its logits.
            fresh.add(total - 1)
            if self._reused(pieces, total - 1):
                cached -= 1
        order = sorted(fresh)
        logits = self.runner.forward(cache, [ids[s] for s in order], [positions[s] for s in order], order)
        return Assembled(
            cache=cache,
            logits=logits,
            pieces=tuple(pieces),
            prompt_tokens=total,
            cached_tokens=cached,
            computed_tokens=total - cached,
            recomputed_tokens=reused_recomputed,
            last_position=pieces[-1].segment.end - 1,
        )

    @staticmethod
    def _reused(pieces: list[Piece], slot: int) -> bool:
        for p in pieces:
            if p.slot <= slot < p.slot + len(p.segment):
                return p.source != "fresh" and p.origin != "computed"
        return False

    def _select(self, pieces, cache: SlotCache, ids, positions, recompute: Recompute) -> set[int]:
        """Slots of relocated chunk tokens to recompute (never exact-prefix or fresh tokens)."""
        spans = [(p.slot, p.slot + len(p.segment)) for p in pieces if p.source in ("chunk", "scaffold")]
        candidates = [s for a, b in spans for s in range(a, b)]
        k = round(recompute.ratio * len(candidates))
        if k == 0:
            return set()
        if k >= len(candidates):
            return set(candidates)
        if recompute.select == "chunk_start":
            return {s for a, b in spans for s in range(a, a + math.ceil(recompute.ratio * (b - a)))}
        # CacheBlend: fresh keys of an early layer, with the whole prompt as context, against the cached
        # (relocated) keys.
        m = candidates[-1] + 1
        layer = recompute.probe_layer
        fresh_keys = self.runner.probe_keys(ids[:m], positions[:m], layer)  # [H, m, D]
        cached_keys = cache.keys[layer, 0, :, :m]
        deviation = (fresh_keys.float() - cached_keys.float()).norm(dim=-1).sum(0)  # [m]
        cand = torch.tensor(candidates, device=deviation.device)
        top = torch.topk(deviation[cand], k).indices
        return {candidates[i] for i in top.tolist()}

    def save_prefix_nodes(self, assembled: Assembled) -> None:
        """Store the exact-prefix nodes this request computed: the leading run of segments whose KV is
        exact (everything before the first relocated block), except the last segment."""
        for p in assembled.pieces:
            if p.source != "fresh" or p.key is None:
                continue
            seg = p.segment
            k, v = assembled.cache.block_views(p.slot, p.slot + len(seg))
            self.store.put(p.key, KVBlock(k.clone(), v.clone(), seg.token_ids, seg.start, {"kind": "prefix"}))
