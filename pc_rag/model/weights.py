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
(`few_rows_limit`), then whether it also takes up to BATCH_ROWS (a batched step's); more rows always go to oneDNN.
The runner records the answer (backends.py) and multiplies through `Weights.routed`, its own view of the shared
packed weights. Where the products alone lose at BATCH_ROWS, a whole step of that many requests may still be
faster as one native call over them (fused.py, `FusedLayers._time_batches`, timed once the fused layers are
built).

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

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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
    back into one output per module (or into `splits` of a fused module's output). Products of at most `few_rows`
    rows go to `few` (kernels.LinearRows over the modules' own weights) instead, in a runner's view (`routed`)."""

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
        self.dtype = weight.dtype
        self.module_weights = [m.weight.detach() for m in modules]  # what linear_rows reads (no copy)
        self.kernel: kernels.LinearRows | None = None  # linear_rows over them, in a runner's view (`routed`)
        self.few: kernels.LinearRows | None = None  # `kernel` where it takes a few rows' products, else None
        self.few_rows = 0  # the most rows `few` takes: FEW_ROWS or BATCH_ROWS, as timed at load

    def routed(self, fn, rows: int) -> Packed:
        """This product sharing its packed weights, with products of up to `rows` rows through linear_rows (`fn`,
        None: none; rows 0: the kernel kept for the fused step's choice, not used by `product`)."""
        view = copy.copy(self)
        view.kernel = None if fn is None else kernels.LinearRows(fn, [w.contiguous() for w in self.module_weights],
                                                                 self.bias)
        view.few = view.kernel if rows else None
        view.few_rows = rows if view.kernel is not None else 0
        return view

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
    # few_rows_limit's timings of these weights: id(linear_rows fn) -> (fn, rows, why); shared by the views
    timed: dict = field(default_factory=dict, compare=False, repr=False)

    def routed(self, fn, rows: int) -> Weights:
        """A runner's view of these (shared) weights: products of up to `rows` rows through linear_rows (`fn`, or
        None for none), the packed weights themselves shared."""
        if not self.packed:
            return self
        layers = tuple(replace(lw, qkv=lw.qkv.routed(fn, rows), o=lw.o.routed(fn, rows),
                               gate_up=lw.gate_up.routed(fn, rows), down=lw.down.routed(fn, rows))
                       for lw in self.layers)
        return replace(self, layers=layers, lm_head=self.lm_head.routed(fn, rows))


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
    by `arch`), packed on CPU where that runs (see the module docstring), built once per model object: engines over
    one model share one packed copy (each runner multiplies through its own `routed` view of it)."""
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
        _SHARED[model] = found
        return found


def few_rows_limit(w: Weights, fn) -> tuple[int, str]:
    """How many rows' products go to linear_rows (`fn`) rather than oneDNN for these packed weights, and why:
    0, FEW_ROWS or BATCH_ROWS, as timed (`_few_rows_faster`) once per model and kernel, then kept on `w`."""
    with _SHARED_LOCK:
        if id(fn) not in w.timed:  # (ctypes functions do not hash); the entry keeps `fn` alive, so its id stays its
            view = w.routed(fn, FEW_ROWS)
            one, one_why = _few_rows_faster(view, 1)
            if not one:
                rows, why = 0, f"oneDNN: faster for one row at load ({one_why})"
            else:
                batch, batch_why = _few_rows_faster(view, BATCH_ROWS)
                rows = BATCH_ROWS if batch else FEW_ROWS
                why = f"up to {rows} rows, faster at load (1 row: {one_why}; {BATCH_ROWS} rows: {batch_why})"
            w.timed[id(fn)] = (fn, rows, why)
        return w.timed[id(fn)][1:]


def _packed_products(w: Weights) -> list[Packed]:
    return [*(p for lw in w.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)), w.lm_head]


# Enough weights for the timing below to read them from memory, as a decode step does, not from the CPU's caches.
TIMED_BYTES = 256 << 20


@torch.inference_mode()
def _few_rows_faster(w: Weights, rows: int) -> tuple[bool, str]:
    """Whether products of `rows` rows run faster through kernels.linear_rows (`w`'s `few`) than through oneDNN's
    packed weights, timed on the MLP products of as many layers as make TIMED_BYTES (alternating, medians of 5: a
    busy moment hits both alike); the kernel must be at least as fast. By CPU and dtype, the answer differs (module
    docstring). With the times, in words."""
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
    return ours <= theirs, (f"linear_rows {ours * 1e3:.2f} ms, oneDNN {theirs * 1e3:.2f} ms over the MLP weights of "
                            f"{len(layers)} layers")


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
