"""A request's KV buffer (`SlotCache`), the shape of a model's KV (`ModelShape`), and moving blocks between devices.

The buffer is one preallocated tensor pair per request for all layers,
    keys, values: [layers, 1, kv_heads, capacity, head_dim],
indexed by *slot* (a token's index in the prompt). Cached blocks are copied (keys relocated by RoPE rotation,
rope.py) straight into their slots; fresh tokens are written by pc_rag's own layer loop (runner.py) into theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SlotCache:
    """A request's preallocated KV buffer, written by slot: keys, values [layers, 1, kv_heads, capacity, head_dim].

    Slots [0, length) are valid. Only pc_rag's own layer loop (LlamaRunner) writes it; it is not an HF cache
    object, so no transformers cache API is involved in a request."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.keys = torch.empty(num_layers, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

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
