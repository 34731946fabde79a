"""A decoder's linear layers as the forward passes multiply by them: fused and packed by oneDNN on CPU.

torch's `F.linear` on CPU goes to MKL, which on the AMD EPYC we measure on ran far below the machine
(2 threads, bench model's layer shapes, quiet machine, `benchmarks/peers.py` keeps the figures current):

| product | F.linear (MKL) | oneDNN, weights packed once |
|---|---|---|
| fp32, 2048 rows (prefill) | 113-134 GFLOP/s | 191-201 GFLOP/s |
| fp32, 1 row (decode) | 10 GB/s of weights | 17-19 GB/s |
| fp32, 8 rows (batched decode) | 6 GB/s | 17 GB/s |
| bf16, 1 / 8 rows | 9 / 8 GB/s | 13-15 / 14-15 GB/s |

On an Intel Xeon with AMX (2026-12-02, 1 row, 24 weights in turn so they come from memory): fp32 F.linear 17-25
GB/s against packed 13-20, bf16 8.5-12 against 10-16: all below what the machine reads (18-24 GB/s). pc_rag's own
kernel for a few rows (kernels.linear_rows, linear_rows.cpp, on the modules' own weights) read them there at
1.3-1.7x oneDNN's packed rate in bf16 and 1.0-1.2x MKL's in fp32 (2026-12-03), up to 4 rows; from 6 rows oneDNN's
AMX tiles catch up in bf16, while in fp32 a batched step of 8 rows was faster through the kernel (bench model, 8
requests: 14.3 against 16.0 ms a step). An earlier version of it on the AMD EPYC was ahead in fp32 and not in
bf16. So which one takes products of up to FEW_ROWS rows (a decode step's) is timed once per model at load
(`_few_rows_faster`), then whether it also takes up to BATCH_ROWS (a batched step's), and logged; more rows always
go to oneDNN. Where the products alone lose at BATCH_ROWS, a whole step of that many requests may still be faster
as one native call over them (fused.py, `FusedLayers._time_batches`, timed once the fused layers are built).

So on CPU each layer's q/k/v projections (and gate/up) are concatenated into one weight and reordered once into
oneDNN's blocked layout ("packed", without a batch-size hint: measured best across 1 to 2048 rows), and the
forward calls oneDNN's linear op on them. The cost is memory: the packed weights are a second copy of the
decoder's linear weights (the model's own modules keep theirs, so the HF model still works as loaded, and
`LlamaRunner.reference_logits` stays an independent reference). Engines over one model share one packed copy.
Half precision fp16 (no fast oneDNN path on CPUs without AVX512-FP16), CUDA, and any torch whose oneDNN op fails
the check below use the modules themselves. Weights changed in place after packing are not seen (nor by the
model fingerprint, which is computed once).

Which modules a layer has (norms before or after each sublayer, q/k norms, fused projections) comes from the
model's Architecture (architecture.py): a norm the family does not have is None here, not an identity module.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError
from . import kernels
from .architecture import Architecture

log = logging.getLogger("pc_rag.weights")

PACKED_DTYPES = (torch.float32, torch.bfloat16)
FEW_ROWS = 4  # products of at most this many rows go through kernels.linear_rows where it runs (docstring)
BATCH_ROWS = 8  # and of up to this many where it was faster at this many rows too, timed at load


class Plain:
    """y = x W^T + b through the model's own modules: one output per module, or a fused module's output split
    into `splits` (Phi-3's q|k|v and gate|up)."""

    def __init__(self, modules: list[torch.nn.Module], splits: list[int] | None = None):
        self.modules = modules
        self.splits = splits

    def __call__(self, x: torch.Tensor):
        outs = [m(x) for m in self.modules]
        if self.splits is not None:
            return list(outs[0].split(self.splits, -1))
        return outs if len(outs) > 1 else outs[0]


class Packed:
    """The modules' weights concatenated ([out_1 + out_2 + ..., in]) and reordered by oneDNN; the product is split
    back into one output per module (or into `splits` of a fused module's output)."""

    def __init__(self, modules: list[torch.nn.Module], splits: list[int] | None = None):
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        biases = [m.bias for m in modules]
        if any(b is not None for b in biases):
            biases = [b.detach() if b is not None else weight.new_zeros(m.weight.shape[0])
                      for b, m in zip(biases, modules, strict=True)]
            self.bias = torch.cat(biases)
        else:
            self.bias = None
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.splits = splits if splits is not None else [m.weight.shape[0] for m in modules]
        # A few rows' products through the kernel on the modules' own weights (the docstring): None where it does
        # not run here, or where oneDNN was faster at load.
        fn = kernels.linear_rows_kernel(weight.dtype)
        self.few = None if fn is None else kernels.LinearRows(fn, [m.weight.detach().contiguous() for m in modules],
                                                                self.bias)
        self.kernel = self.few  # what `few` is when the timing at load (weights_of) picks the kernel
        self.few_rows = FEW_ROWS  # the most rows `few` takes: FEW_ROWS or BATCH_ROWS, as timed at load

    def takes_few(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes to the kernel (`few`) rather than to oneDNN."""
        return self.few is not None and rows <= self.few_rows

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, in] (rows contiguous) times the weights, unsplit: [B, out]."""
        if self.takes_few(x.shape[0]) and self.few.fits(x):
            return self.few.run(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def __call__(self, x: torch.Tensor):
        y = self.product(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return list(y.split(self.splits, -1)) if len(self.splits) > 1 else y


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, as the forward passes call it; the norms a family lacks are None."""

    input_norm: torch.nn.Module | None  # before attention
    qkv: Callable  # x [.., hidden] -> [q, k, v] projections
    q_norm: torch.nn.Module | None  # Architecture.qk_norm says over what
    k_norm: torch.nn.Module | None
    o: Callable
    attn_out_norm: torch.nn.Module | None  # on the attention output, before the residual add
    mlp_norm: torch.nn.Module | None  # before the MLP
    gate_up: Callable  # x -> [gate, up]
    down: Callable
    act: Callable
    mlp_out_norm: torch.nn.Module | None  # on the MLP output, before the residual add


@dataclass(frozen=True)
class Weights:
    layers: tuple[LayerWeights, ...]
    lm_head: Callable
    packed: bool  # whether the products go through oneDNN packed weights


def _packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's packed linear runs here and agrees with F.linear (one small product, checked once)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        x = torch.randn(3, 40, generator=g).to(dtype)
        m = torch.nn.Linear(40, 24, dtype=dtype)
        m.weight.data, m.bias.data = w, b
        got, want = Packed([m])(x).float(), torch.nn.functional.linear(x, w, b).float()
        return bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2))
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # a torch without the op: plain products
        log.info("oneDNN packed linear unavailable (%s); using the model's own linear layers", e)
        return False


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Weights, one packed copy per model
_SHARED_LOCK = threading.Lock()


def weights_of(model, arch: Architecture) -> Weights:
    """The layer weights of an HF decoder `...ForCausalLM` (its `model.layers[i].self_attn`/`.mlp` modules, named
    by `arch`), packed on CPU where that runs (see the module docstring), built once per model object."""
    p = next(model.parameters())
    num_layers = len(arch.layers)
    with _SHARED_LOCK:
        found = _SHARED.get(model)
        if found is not None and len(found.layers) == num_layers:
            return found
        pack = _packs(p.dtype, p.device)
        kind = Packed if pack else Plain
        q_size, kv_size = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
        layers = []
        for i, layer in enumerate(model.model.layers[:num_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [_module(attn, name, arch, i) for name in arch.qkv]
            gate_up = [_module(mlp, name, arch, i) for name in arch.gate_up]
            norms = arch.norms
            layers.append(LayerWeights(
                input_norm=_module(layer, norms.before_attention, arch, i),
                qkv=kind(qkv, [q_size, kv_size, kv_size] if len(qkv) == 1 else None),
                q_norm=_module(attn, "q_norm" if arch.qk_norm else None, arch, i),
                k_norm=_module(attn, "k_norm" if arch.qk_norm else None, arch, i),
                o=kind([attn.o_proj]),
                attn_out_norm=_module(layer, norms.after_attention, arch, i),
                mlp_norm=_module(layer, norms.before_mlp, arch, i),
                gate_up=kind(gate_up, [gate_up[0].weight.shape[0] // 2] * 2 if len(gate_up) == 1 else None),
                down=kind([mlp.down_proj]),
                act=_module(mlp, arch.act, arch, i),
                mlp_out_norm=_module(layer, norms.after_mlp, arch, i),
            ))
        found = Weights(tuple(layers), kind([model.lm_head]), pack)
        if pack and found.layers[0].gate_up.few is not None:
            rows = FEW_ROWS if _few_rows_faster(found, 1) else 0
            if rows and _few_rows_faster(found, BATCH_ROWS):
                rows = BATCH_ROWS
            for product in _packed_products(found):
                product.few_rows = rows
                if not rows:
                    product.few = None
        _SHARED[model] = found
        return found


def _packed_products(w: Weights) -> list[Packed]:
    return [*(p for lw in w.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)), w.lm_head]


# Enough weights for the timing below to read them from memory, as a decode step does, not from the CPU's caches.
TIMED_BYTES = 256 << 20


@torch.inference_mode()
def _few_rows_faster(w: Weights, rows: int) -> bool:
    """Whether products of `rows` rows run faster through kernels.linear_rows than through oneDNN's packed weights,
    timed on the MLP products of as many layers as make TIMED_BYTES (alternating, medians of 5: a busy moment hits
    both alike); the kernel must be at least as fast. By CPU and dtype, the answer differs (module docstring)."""
    layers, size = [], 0
    for lw in w.layers:
        layers.append(lw)
        size += sum(t.numel() * t.element_size() for t in (*lw.gate_up.few.weights, *lw.down.few.weights))
        if size >= TIMED_BYTES:
            break
    x = torch.randn(rows, layers[0].gate_up.few.k, dtype=layers[0].gate_up.few.dtype)
    a = torch.randn(rows, layers[0].down.few.k, dtype=x.dtype)

    def onednn():
        for lw in layers:
            for p, v in ((lw.gate_up, x), (lw.down, a)):
                torch.ops.mkldnn._linear_pointwise(v, p.weight, p.bias, "none", [], "")

    def kernel():
        for lw in layers:
            for p, v in ((lw.gate_up, x), (lw.down, a)):
                p.few(v)

    times = {onednn: [], kernel: []}
    for _ in range(2):
        onednn(), kernel()
    for _ in range(5):
        for f in times:
            t = time.perf_counter()
            f()
            times[f].append(time.perf_counter() - t)
    theirs, ours = (sorted(times[f])[2] for f in (onednn, kernel))
    log.info("pc_rag: %d-row products %s (MLP weights of %d layers: oneDNN %.2f ms, linear_rows %.2f ms)", rows,
             "through linear_rows" if ours <= theirs else "through oneDNN", len(layers), theirs * 1e3, ours * 1e3)
    return ours <= theirs


def _module(parent: torch.nn.Module, name: str | None, arch: Architecture, i: int):
    """`parent.name` (None for no name), or an error naming what the description expected and did not find."""
    if name is None:
        return None
    found = getattr(parent, name, None)
    if found is None:
        raise UnsupportedModelError(
            f"{arch.model_type}: layer {i} has no {type(parent).__name__}.{name}, which pc_rag's description of "
            f"this family reads (a transformers version whose modeling code differs?)")
    return found
