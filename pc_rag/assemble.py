"""From token segments to an assembled cache and the prompt's last logits.

A plan says, for every segment of the prompt, where its KV comes from:
- "prefix": an exact-prefix trie node (KV computed after exactly this prefix: identical to full prefill);
- "chunk":  a chunk encoded on its own after the sink prefix, RoPE-relocated to its place (approximation:
            it never saw the segments before it);
- "fresh":  computed in this request's single forward pass, attending to everything before it.
Planning is plain Python over the store; `assemble` then copies blocks into the request's slots and runs
one forward for all fresh tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import KVBlock, chunk_key, prefix_key
from .errors import PromptError, UnsupportedModelError
from .model import LlamaRunner, SlotCache
from .segments import TokenSegment
from .store import get_with_source

MODES = ("full", "exact", "modular")


@dataclass(frozen=True)
class Piece:
    segment: TokenSegment
    slot: int  # first slot (= index of its first token in the prompt)
    source: str  # "fresh" | "prefix" | "chunk"
    key: str | None = None  # store key it came from or will be saved under
    block: KVBlock | None = None
    origin: str | None = None  # store tier (or "computed" for a chunk encoded by this request)


@dataclass(frozen=True)
class Assembled:
    cache: SlotCache
    logits: torch.Tensor  # [vocab] fp32, next-token logits after the prompt
    pieces: tuple[Piece, ...]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    last_position: int


class Assembler:
    """Plans and builds the cache for one prompt, in one of MODES."""

    def __init__(self, runner: LlamaRunner, store, sink_ids: tuple[int, ...]):
        self.runner = runner
        self.store = store
        self.sink_ids = sink_ids  # what every chunk is encoded after (BOS when the tokenizer has one)
        self.root = "root-" + runner.fingerprint

    # ---- planning -------------------------------------------------------------------------------------
    def plan(self, segments: list[TokenSegment], mode: str) -> list[Piece]:
        if mode not in MODES:
            raise PromptError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode == "modular" and not self.runner.relocatable:
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
        for j in range(i, len(segments)):
            seg = segments[j]
            if mode == "modular" and seg.kind == "chunk":
                start = seg.encode_start if seg.encode_start is not None else len(self.sink_ids)
                key = chunk_key(self.runner.fingerprint, seg.token_ids, self.sink_ids, start)
                block, origin = get_with_source(self.store, key)
                if block is not None and block.token_ids != seg.token_ids:
                    block = None  # a key collision or a foreign entry: never use KV for other tokens
                if block is None:
                    block, origin = self.encode_chunk(seg.token_ids, start), "computed"
                    self.store.put(key, block)
                pieces.append(Piece(seg, slots[j], "chunk", key, block, origin))
            else:
                key = None
                # Only segments before the first relocated chunk have exact KV worth a trie node.
                exact_so_far = all(p.source != "chunk" for p in pieces)
                if mode != "full" and j < len(segments) - 1 and exact_so_far:
                    key = prefix_key(self.runner.fingerprint, parent, seg.token_ids, seg.start)
                    parent = key
                pieces.append(Piece(seg, slots[j], "fresh", key))
        return pieces

    @torch.inference_mode()
    def encode_chunk(self, token_ids: tuple[int, ...], start: int) -> KVBlock:
        """Encode a chunk on its own: sink tokens at 0.., the chunk's first token at `start`."""
        n_sink = len(self.sink_ids)
        ids = list(self.sink_ids) + list(token_ids)
        positions = list(range(n_sink)) + list(range(start, start + len(token_ids)))
        cache = self.runner.new_cache(len(ids))
        self.runner.forward(cache, ids, positions, list(range(len(ids))))
        k, v = cache.block_views(n_sink, len(ids))
        return KVBlock(k.clone(), v.clone(), tuple(token_ids), start, {"kind": "chunk"})

    # ---- building -------------------------------------------------------------------------------------
    def assemble(self, pieces: list[Piece], extra_capacity: int) -> Assembled:
        total = pieces[-1].slot + len(pieces[-1].segment)
        cache = self.runner.acquire_cache(total + extra_capacity)
        fresh_ids: list[int] = []
        fresh_pos: list[int] = []
        fresh_slots: list[int] = []
        cached = 0
        for p in pieces:
            seg, n = p.segment, len(p.segment)
            if p.source == "fresh":
                fresh_ids.extend(seg.token_ids)
                fresh_pos.extend(range(seg.start, seg.end))
                fresh_slots.extend(range(p.slot, p.slot + n))
                continue
            dk, dv = cache.block_views(p.slot, p.slot + n)
            self.runner.relocate(dk, p.block.keys, seg.start - p.block.start)
            dv.copy_(p.block.values)
            if p.origin != "computed":  # encoded by this very request: computed, not reused
                cached += n
        if not fresh_slots or fresh_slots[-1] != total - 1:
            # The prompt ends inside a cached block: recompute its last token so we have its logits.
            last = pieces[-1].segment
            fresh_ids.append(last.token_ids[-1])
            fresh_pos.append(last.end - 1)
            fresh_slots.append(total - 1)
            if pieces[-1].origin != "computed":
                cached -= 1
        # Slots already hold the cached blocks; cache.length must cover them before the forward.
        cache.length = total
        logits = self.runner.forward(cache, fresh_ids, fresh_pos, fresh_slots)
        return Assembled(
            cache=cache,
            logits=logits,
            pieces=tuple(pieces),
            prompt_tokens=total,
            cached_tokens=cached,
            computed_tokens=total - cached,
            last_position=pieces[-1].segment.end - 1,
        )

    def save_prefix_nodes(self, assembled: Assembled) -> None:
        """Store the exact-prefix nodes this request computed: the leading run of segments whose KV is
        exact (everything before the first relocated chunk), except the last segment."""
        for p in assembled.pieces:
            if p.source != "fresh" or p.key is None:
                continue
            seg = p.segment
            k, v = assembled.cache.block_views(p.slot, p.slot + len(seg))
            self.store.put(p.key, KVBlock(k.clone(), v.clone(), seg.token_ids, seg.start, {"kind": "prefix"}))

