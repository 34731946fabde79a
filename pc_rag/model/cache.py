"""A request's KV buffer (`SlotCache`), the shape of a model's KV (`ModelShape`), and moving blocks between devices.

The buffer is one preallocated tensor pair per request for all layers,
    keys, values: [layers, 1, kv_heads, capacity, head_dim],
indexed by *slot* (a token's index in the prompt). Cached blocks are copied (keys relocated by RoPE rotation,
rope.py) straight into their slots; fresh tokens are written by pc_rag's own layer loop (runner.py) into theirs.

A buffer back in the pool still holds the blocks its last request copied in (`held`), up to the first slot anything
wrote over them (`wrote`): the next request that wants the same block in the same slots at the same position (a
system text or a conversation sent again, the next question on the same documents) finds it there and copies
nothing (`LlamaRunner.acquire_cache`, `Assembler.assemble`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class HeldBlock:
    """Slots [slot, slot + n) of a buffer hold the first n tokens' KV of the store's block `key`, its keys at
    position ids from `position` on. Keys name their content (token ids, context, namespace: blocks.py), so that is
    the same KV whichever copy of the block it came from."""

    key: str
    slot: int
    n: int
    position: int


class SlotCache:
    """A request's preallocated KV buffer, written by slot: keys, values [layers, 1, kv_heads, capacity, head_dim].

    Slots [0, length) are valid. Only pc_rag's own layer loop (LlamaRunner) writes it; it is not an HF cache
    object, so no transformers cache API is involved in a request."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.keys = torch.empty(num_layers, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0
        self.hold(())  # `held`: the blocks copied in and not written over since

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def hold(self, blocks: tuple[HeldBlock, ...]) -> None:
        """Record the blocks now in their slots (the assembler, once it has copied them in)."""
        self.held = blocks
        self._held_n: dict[tuple[str, int, int], int] = {}  # (key, slot, position) -> tokens held there
        for b in blocks:
            at = (b.key, b.slot, b.position)
            self._held_n[at] = max(b.n, self._held_n.get(at, 0))
        self._held_end = max((b.slot + b.n for b in blocks), default=0)

    def wrote(self, start: int, stop: int) -> None:
        """Slots [start, stop) are being written: a held block there holds what it did only up to `start`. Every
        write of the layer loop calls it (runner.py), before writing."""
        if start >= self._held_end or stop <= start:  # decoding: after every held block
            return
        self.hold(tuple(b if b.slot >= stop or b.slot + b.n <= start else replace(b, n=start - b.slot)
                        for b in self.held if b.slot >= stop or b.slot < start))

    def holds(self, key: str, slot: int, n: int, position: int) -> bool:
        """Whether slots [slot, slot + n) hold block `key`'s first n tokens at `position`."""
        return 0 < n <= self._held_n.get((key, slot, position), 0)

    def block_views(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [a, b) of every layer: ([L, H_kv, b-a, D], same) views."""
        return self.keys[:, 0, :, a:b], self.values[:, 0, :, a:b]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    # The smallest sliding window of any layer (None: every layer attends to the whole prompt). Informational: each
    # windowed layer is masked to its own window exactly (attention.py), so no prompt length is refused for it.
    sliding_window: int | None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


def _may_copy_async(src: torch.device, dst: torch.device) -> bool:
    # Host to accelerator may be asynchronous: the copy is queued on the stream before any kernel that reads
    # the result (and overlaps with the host when the source is pinned). The other way round the host could
    # read the result before the copy lands, so it stays synchronous.
    return src.type == "cpu" and dst.type not in ("cpu", "meta")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    return t.to(device, non_blocking=_may_copy_async(t.device, device))
