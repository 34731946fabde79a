"""A request's KV buffer (`SlotCache`), the shape of a model's KV (`ModelShape`), and moving blocks between devices.

The buffer is one preallocated tensor pair per request for all layers,
    keys, values: [layers, 1, kv_heads, capacity, head_dim],
indexed by *slot* (a token's index in the prompt). Cached blocks are copied (keys relocated by RoPE rotation,
rope.py) straight into their slots; fresh tokens are written by pc_rag's own layer loop (runner.py) into theirs.

A buffer back in the pool still holds the blocks its last request copied in (`held`), up to the first slot anything
wrote over them (`wrote`): the next request that wants the same block in the same slots at the same position (a
system text or a conversation sent again, the next question on the same documents) finds it there and copies
nothing (`LlamaRunner.acquire_cache`, `Assembler.assemble`).

A prompt that starts with prefix blocks other requests start with too (a system text, a shared instruction) reads
them in place from one `SharedPrefix` (slots [0, n) of every layer, never written after it is built), and its
buffer holds slots [n, ...) only (`SlotCache.base`, `offset`): concurrent requests over one prefix hold its KV
once, each buffer growing with the request's own tokens. Attention reads both and merges them by their log-sum-exp
(attention.py); `LlamaRunner.shared_prefix` keeps them.
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


class SharedPrefix:
    """Slots [0, n) of a prompt, read in place by every request whose prompt starts with the same `blocks`:
    keys, values [layers, 1, kv_heads, n, head_dim], written once when built, then only read. `users`: the
    requests attached (LlamaRunner counts them under its lock)."""

    def __init__(self, blocks: tuple[HeldBlock, ...], keys: torch.Tensor, values: torch.Tensor):
        self.blocks, self.keys, self.values = blocks, keys, values
        self.n = keys.shape[3]
        self.users = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class SlotCache:
    """A request's preallocated KV buffer, written by slot: keys, values [layers, 1, kv_heads, capacity, head_dim].

    Slots [0, length) are valid. Only pc_rag's own layer loop (LlamaRunner) writes it; it is not an HF cache
    object, so no transformers cache API is involved in a request."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.keys = torch.empty(num_layers, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0
        self.base: SharedPrefix | None = None  # slots [0, offset) read in place; keys/values hold the slots after
        self.align = None  # the request's attention alignment over reused chunks (aligned.Aligned), while it runs
        self.hold(())  # `held`: the blocks copied in and not written over since

    @property
    def offset(self) -> int:
        """The first slot this buffer holds: slots before it are its shared prefix's."""
        return 0 if self.base is None else self.base.n

    @property
    def capacity(self) -> int:
        """Slots a request can fill: its shared prefix's, then this buffer's."""
        return self.offset + self.keys.shape[3]

    @property
    def own_capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def attach(self, base: SharedPrefix | None) -> None:
        """Slots [0, base.n) are `base`'s from now on; this buffer's slot 0 is slot base.n (None: detach). What it
        held from its last request is no longer in its slots."""
        self.base = base
        self.hold(())

    def base_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared prefix's keys and values of one layer, [1, H_kv, n, D] (None: no shared prefix)."""
        return None if self.base is None else (self.base.keys[layer], self.base.values[layer])

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
        """Slots [a, b) of every layer, to write: ([L, H_kv, b-a, D], same) views of this buffer (never of the
        shared prefix, which is read-only)."""
        off = self.offset
        if a < off:
            raise ValueError(f"slots [{a}, {b}) lie in the shared prefix [0, {off}): it is read-only")
        return self.keys[:, 0, :, a - off:b - off], self.values[:, 0, :, a - off:b - off]

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [a, b) of every layer, to read: ([L, H_kv, b-a, D], same), views where the slots lie on one side of
        the shared prefix's end, a copy where they straddle it."""
        off = self.offset
        if a >= off:
            return self.block_views(a, b)
        base = self.base.keys[:, 0, :, a:min(b, off)], self.base.values[:, 0, :, a:min(b, off)]
        if b <= off:
            return base
        own = self.block_views(off, b)
        return torch.cat([base[0], own[0]], 2), torch.cat([base[1], own[1]], 2)


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
