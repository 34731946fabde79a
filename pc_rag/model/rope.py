"""RoPE per layer: the tables a model's layers rotate with, relocation of cached keys, and the relocation self-check.

HF's RoPE rotates the halves (x1, x2) of a head's first `rotary_dims` dims by angle p * inv_freq (the rest pass
through: Phi-3/4's partial rotary). Rotating a key computed at p once more by delta * inv_freq gives the key at
p + delta exactly (up to float rounding; attention scaling, as in yarn, is a constant factor that commutes with the
rotation). So a cached block moves to another position by rotating its keys, layer by layer with that layer's
table: Gemma 3's local and global layers have their own bases, SmolLM3's NoPE layers none (their keys are copied).

The self-check (`check`): a description can be wrong (a family file, or a transformers version that changed a
modeling file), and a wrong rotation does not fail, it garbles replies. So before a model's first modular or
blend request, a probe's keys are computed at two positions in every layer (by pc_rag's own forward, as every
request computes them), one relocated onto the other, and compared layer by layer; on a mismatch those modes are
refused, naming the layer. The result is kept per model fingerprint, rotation and relocation backend (one check
per process: engines over one model share it), with its time in milliseconds.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .architecture import Architecture
from .backends import Backends
from .cache import _may_copy_async, _to_device

# RoPE variants whose inverse frequencies do not depend on the sequence length: rotating a cached key by
# delta positions is then exactly the key computed at the new position (up to float rounding).
# "dynamic" and "longrope" rescale with the sequence length, and M-RoPE ("mrope") rotates sections by positions
# of other modalities, so a relocated key would be wrong.
RELOCATABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeTable:
    name: str
    rope_type: str
    inv_freq: torch.Tensor  # [rotary_dims / 2] fp32, on the model's device

    @property
    def rotary_dims(self) -> int:
        return 2 * self.inv_freq.shape[0]


@dataclass(frozen=True)
class Run:
    """Consecutive layers [start, stop) whose keys relocate alike: by one table, or copied (table None: NoPE)."""

    start: int
    stop: int
    table: RopeTable | None


@dataclass(frozen=True)
class Rope:
    tables: dict[str, RopeTable]
    runs: tuple[Run, ...]
    @functools.cached_property
    def key(self) -> str:
        """A digest of the rotation itself (each run's layers, table and frequencies): part of the self-check's key,
        so a rotation that differs (another description of the same weights) is checked anew. Computed once."""
        h = hashlib.blake2b(digest_size=8)
        for run in self.runs:
            h.update(f"{run.start}:{run.stop}:".encode())
            if run.table is not None:
                h.update(f"{run.table.name}:{run.table.rope_type}:".encode())
                h.update(run.table.inv_freq.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    @property
    def relocatable(self) -> bool:
        return all(t.rope_type in RELOCATABLE_ROPE_TYPES for t in self.tables.values())

    @property
    def rope_type(self) -> str:
        """The rope_type (the first that cannot be relocated, if any; "a/b" for several)."""
        bad = [t.rope_type for t in self.tables.values() if t.rope_type not in RELOCATABLE_ROPE_TYPES]
        return bad[0] if bad else "/".join(sorted({t.rope_type for t in self.tables.values()})) or "none"


def rope_of(model, arch: Architecture) -> Rope:
    """The RoPE tables of `model`'s rotary module, as `arch` names them, and the layers that use each."""
    rotary = model.model.rotary_emb
    tables = {}
    for name, rope_type in arch.rope_types:
        inv = getattr(rotary, f"{name}_inv_freq") if arch.rope_by_layer_type else rotary.inv_freq
        tables[name] = RopeTable(name, rope_type, inv.detach().to(torch.float32))
    runs: list[Run] = []
    for i, layer in enumerate(arch.layers):
        table = tables[layer.rope] if layer.rope is not None else None
        if runs and runs[-1].table is table:
            runs[-1] = Run(runs[-1].start, i + 1, table)
        else:
            runs.append(Run(i, i + 1, table))
    return Rope(tables, tuple(runs))


@torch.inference_mode()
def relocate(rope: Rope, dst: torch.Tensor, src: torch.Tensor, delta: int, backends: Backends) -> None:
    """Write keys `src` ([L, H, T, D], RoPE at p) into `dst` as if computed at p + delta, each layer by its table,
    in bf16 by the native kernel where the runner chose it (`backends.relocation`).

    `src` may live on another device than `dst` (a block read from disk or Redis is on the CPU): it is copied to
    `dst`'s device once, in its own dtype, and rotated there.
    """
    if delta == 0:
        dst.copy_(src, non_blocking=_may_copy_async(src.device, dst.device))  # across devices if need be
        return
    src = _to_device(src, dst.device)
    whole = len(rope.runs) == 1  # every layer alike (Llama): no per-run views
    for run in rope.runs:
        d, s = (dst, src) if whole else (dst[run.start: run.stop], src[run.start: run.stop])
        if run.table is None:
            d.copy_(s)
        else:
            _rotate(d, s, run.table, delta, backends.relocate_kernel)


def _rotate(dst: torch.Tensor, src: torch.Tensor, table: RopeTable, delta: int, kernel) -> None:
    r = table.rotary_dims
    h = r // 2
    if r < src.shape[-1]:  # partial rotary: the other dims carry no position
        dst[..., r:] = src[..., r:]
    angle = delta * table.inv_freq.to(dst.device)
    cos, sin = angle.cos(), angle.sin()
    if kernel is not None and _rotate_natively(kernel, dst, src, r, cos, sin):
        return
    if src.dtype == dst.dtype == torch.float32:
        k1, k2 = src[..., :h], src[..., h:r]
        o1, o2 = dst[..., :h], dst[..., h:r]
        torch.mul(k1, cos, out=o1)
        o1.addcmul_(k2, sin, value=-1.0)
        torch.mul(k2, cos, out=o2)
        o2.addcmul_(k1, sin)
    else:  # half precision: rotate in fp32 so the relocation adds one rounding, not four
        k = src[..., :r].float()  # [L, H, T, r]
        k1, k2 = k[..., :h], k[..., h:]
        dst[..., :h] = k1 * cos - k2 * sin
        dst[..., h:r] = k2 * cos + k1 * sin


def _rotate_natively(kernel, dst: torch.Tensor, src: torch.Tensor, r: int, cos: torch.Tensor,
                     sin: torch.Tensor) -> bool:
    """The half-precision rotation below in one native call (`kernel`: pc_rag_relocate_keys) where it takes the
    tensors: bf16 on CPU, every dim rotary, each row's dims contiguous. The same ops and roundings, bit for bit,
    without the fp32 temporaries: 0.3 against 1.2 ms for 8 layers of a 256-token chunk (bench model), 6-8 of a
    modular request's 45 ms before. (fp32 runs 4 torch ops into `dst`, as fast as the kernel.) Returns whether it
    ran."""
    if (dst.device.type != "cpu" or dst.dtype != torch.bfloat16 or src.device != dst.device
            or src.dtype != dst.dtype or r != dst.shape[-1] or dst.dim() != 4 or dst.shape != src.shape
            or dst.stride(-1) != 1 or src.stride(-1) != 1):
        return False
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return kernel(*dst.shape, src.data_ptr(), *src.stride()[:3], dst.data_ptr(), *dst.stride()[:3],
                  cos.data_ptr(), sin.data_ptr()) == 0


# ---- the self-check --------------------------------------------------------------------------------------------
PROBE_TEXT = ("Relocation check: the same words encoded at two positions must give keys that differ by a rotation "
              "only, in every layer of the model.")
# Positions the probe moves by: far enough that every frequency a wrong table or a wrong set of dims would get
# wrong turns by a visible angle, and within any context pc_rag runs.
PROBE_DELTA = 1000
# Largest relative key error (max |relocated - direct| / max |direct|, per layer) taken as rounding. Measured on
# the tiny test model of every family (tests/test_families.py): fp32 at most 2.5e-5 (the angle of position 1000 in
# fp32); bf16 at most 8.6e-3 (HF rounds cos/sin and the rotated key to bf16). Each layer's two keys come from the
# same input, so rounding does not compound with depth. A wrong rotation (another base, rotated or unrotated
# dims, a NoPE layer rotated) is off by 1.5 to 2 (the four tests/test_families.py refuses).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 0.05


@dataclass(frozen=True)
class RelocationCheck:
    model: str
    ok: bool
    layer: int  # the first layer beyond tolerance, else the one with the largest error
    error: float  # its max |relocated - direct| / max |direct|
    tolerance: float
    delta: int  # positions the probe was moved by
    ms: float  # how long the check took

    def as_dict(self) -> dict:
        return asdict(self)


# (fingerprint, rotation digest, relocation backend) -> result, process-wide: engines over one model share a check.
_CHECKS: dict[tuple[str, str, str], RelocationCheck] = {}
_CHECKS_LOCK = threading.Lock()


def checked(fingerprint: str, rope: Rope, backends: Backends) -> RelocationCheck | None:
    """The self-check's result for this model, rotation and relocation backend, if it ran in this process."""
    return _CHECKS.get((fingerprint, rope.key, backends.relocation.backend))


def check(fingerprint: str, rope: Rope, model: str, probe: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
          n: int, dtype: torch.dtype, max_positions: int, backends: Backends) -> RelocationCheck:
    """Run the self-check once per (fingerprint, rotation, relocation backend): `probe(delta)` returns the keys
    [L, H, T, D] of an `n`-token probe at positions 0.. and at delta.. in every layer, each layer's two from the
    same layer input; the first, relocated by delta as `backends` relocates, must equal the second in every
    layer."""
    key = (fingerprint, rope.key, backends.relocation.backend)
    with _CHECKS_LOCK:  # one check at a time: a second caller waits for the first's result
        if key in _CHECKS:
            return _CHECKS[key]
        t0 = time.perf_counter()
        delta = max(1, min(PROBE_DELTA, max_positions - n))
        near, far = probe(delta)
        moved = torch.empty_like(near)
        relocate(rope, moved, near, delta, backends)
        moved, far = moved.float(), far.float()
        scale = far.flatten(1).abs().amax(1).clamp_min(1e-6)  # [L]
        errors = (moved - far).flatten(1).abs().amax(1) / scale  # [L]
        tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
        # The first layer beyond tolerance (layers are checked independently: each one's two keys come from the
        # same input), else the worst one.
        bad = (~(errors <= tolerance)).nonzero()  # NaN counts as beyond
        layer = int(bad[0, 0]) if len(bad) else int(errors.argmax())
        error = float(errors[layer])
        result = RelocationCheck(model, error <= tolerance, layer, error, tolerance, delta,
                                 (time.perf_counter() - t0) * 1e3)
        _CHECKS[key] = result
        return result
