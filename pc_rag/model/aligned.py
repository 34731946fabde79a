"""APE's attention over a request's buffer (pc_rag/align.py says what APE is and why it runs here): which slots hold
reused chunk KV, per layer (`Aligned`, held by the buffer while its request runs: `SlotCache.align`), and the
attention that divides those slots' logits by the temperature and raises them by log S (`attend`).

Plain torch ops (fp32 scores, blocks of query rows): the same code on CPU and CUDA. pc_rag's native kernels and sdpa
take no per-key bias, so a request with APE runs this in its forward and in each decode step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ROWS_PER_BLOCK = 256  # query rows per block of scores: bounds [heads, rows, keys] fp32


class Aligned:
    """A request's alignment, held by its buffer (`SlotCache.align`) while it runs: which slots hold reused chunk
    KV, per layer, and the APE pair.

    reused: [capacity] bool, the slots whose KV came from chunk blocks (queries there are never aligned: blend's
            recomputed chunk rows emulate a full prefill).
    mask:   [layers, capacity] bool, the slots whose keys in that layer are still the cached ones (blend's rows
            computed in a layer are taken out of it: `computed`)."""

    def __init__(self, ape, reused: torch.Tensor, layers: int):
        self.ape = ape  # align.APE: its temperature and scale
        self.reused = reused
        self.mask = reused[None].repeat(layers, 1)

    @classmethod
    def of(cls, ape, slots: Sequence[int], capacity: int, layers: int, device) -> Aligned | None:
        """The alignment of a buffer of `capacity` slots whose `slots` hold reused chunk KV; None without any."""
        if not slots:
            return None
        reused = torch.zeros(capacity, dtype=torch.bool, device=device)
        reused[torch.tensor(list(slots), device=device)] = True
        return cls(ape, reused, layers)

    def computed(self, layer: int, rows: torch.Tensor) -> None:
        """Slots `rows` of `layer` were written by a forward: they hold fresh KV there from now on."""
        self.mask[layer, rows] = False


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, scaling: float,
           group: int, window: int | None, softcap: float | None, aligned: Aligned, layer: int) -> torch.Tensor:
    """APE attention of the query rows q [1, H_q, n, D] at slots `rows` [n] over one layer's keys / values
    [1, H_kv, T, D] (slots [0, T)), each row seeing the slots up to its own (within `window`): the logits over
    `aligned`'s slots of this layer divided by T and raised by log S for rows outside the reused slots (the module
    docstring's formula). Scores and softmax in fp32, in blocks of ROWS_PER_BLOCK rows; returns [1, H_q, n, D] in
    q's dtype."""
    _, h, n, d = q.shape
    h_kv = keys.shape[1]
    inv_t, log_s = 1.0 / aligned.ape.temperature, math.log(aligned.ape.scale)
    cached = aligned.mask[layer]
    out = []
    for a in range(0, n, ROWS_PER_BLOCK):
        at = rows[a: a + ROWS_PER_BLOCK]  # [r] query slots
        r = len(at)
        high = int(at.max()) + 1
        lo = 0 if window is None else max(0, int(at.min()) - window + 1)
        slots = torch.arange(lo, high, device=q.device)
        k = keys[0, :, lo:high].float()  # [H_kv, T', D]
        v = values[0, :, lo:high].float()
        qb = q[0, :, a: a + r].float().reshape(h_kv, group * r, d)  # query heads of one KV head as its rows
        scores = torch.matmul(qb, k.transpose(1, 2)).reshape(h_kv, group, r, -1) * scaling  # [H_kv, g, r, T']
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        boost = (~aligned.reused[at])[:, None] & cached[lo:high][None, :]  # [r, T']: aligned (row, key) pairs
        scores = torch.where(boost, scores * inv_t + log_s, scores)
        visible = slots[None, :] <= at[:, None]
        if window is not None:
            visible &= slots[None, :] > at[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).reshape(h_kv, group * r, -1)
        out.append(torch.matmul(weights, v).reshape(h, r, d))
    o = torch.cat(out, 1) if len(out) > 1 else out[0]
    return o[None].to(q.dtype)
