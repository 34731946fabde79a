"""A decoder's linear layers as the forward passes multiply by them: one copy of the weights, float or quantized.

Float weights (`Packed`): each layer's q/k/v projections (and gate/up) are concatenated once into one matrix, and the
modules' own weights become views of it, so there is one copy (the HF model still runs as loaded, and
`LlamaRunner.reference_logits` stays an independent reference) and one product per group. Products of a decode step's
few rows go to pc_rag's own kernel (kernels.linear_rows, linear_rows.cpp), longer ones to oneDNN's linear op on the
same row-major matrix. A packed copy in oneDNN's blocked layout (what pc_rag kept until 2026-12) was a second copy of
every matrix, 2.3x the weights' bytes in all; on the bench machine (Xeon with AMX, 2 threads, 2026-12-07) the plain
matrix ran the 0.37B shape's products within 0-15% of the packed one from 512 rows up (bf16 4.7 against 5.2 ms for
512 rows of gate|up, fp32 equal within noise) and 30-40% slower at 16-64 rows in bf16 (0.55 against 0.89 ms), where
a prefill is short anyway.

Which of linear_rows and oneDNN takes products of a few rows is timed once per model at load (`few_rows_limit`): on
the Intel Xeon with AMX linear_rows read the weights at 1.3-1.7x oneDNN's rate in bf16 and 1.0-1.2x in fp32 up to 4
rows, and from 6 rows oneDNN's AMX tiles caught up in bf16; on the AMD EPYC it was ahead in fp32, not in bf16. So up
to FEW_ROWS (a decode step's) or BATCH_ROWS (a batched step's) rows go to it where it was faster, more rows always to
oneDNN. The runner records the answer (backends.py) and multiplies through `Weights.routed`, its own view of the
shared weights. Where the products alone lose at BATCH_ROWS, a whole step of that many requests may still be faster
as one native call over them (fused.py, `FusedLayers._time_batches`).

Quantized weights (`Quantized`: quant.QuantLinear modules, from a GGUF file or `quantize=`): the modules' bytes are
the only copy. Up to QUANT_ROWS rows, kernels.QuantRows multiplies straight from them (quant_rows.cpp: the formats'
integers into AVX512-BF16 dot products, in bf16, or through decoded rows in fp32); more rows decode the matrix to
the model's dtype QUANT_TILE_BYTES at a time and multiply by oneDNN, which for a prefill costs the decoding once for
all its rows (`python -m benchmarks.quant_rows`, Xeon with AMX, 2026-12-07; 8 layers' MLP of the 0.37B shape in bf16,
Q4_0: the kernel 4.3 ms for 1 row, 7.7 for 4, 28 for 16, 53 for 32; decoding then oneDNN 18-23 ms from 1 to 16 rows,
26 for 32; Q4_K and Q6_K at the 1B shape cross at 12-16 rows alike). Without the native kernels (CUDA, no AVX-512,
fp16) each product decodes its matrix with torch (quant.dequantize) and multiplies by F.linear.

Half precision fp16 (no fast oneDNN path on CPUs without AVX512-FP16), CUDA, and any torch whose oneDNN op fails the
check below use the modules themselves (`Plain`) for float weights.

Which modules a layer has (norms before or after each sublayer, q/k norms, fused projections) comes from the
model's Architecture (architecture.py): a norm the family does not have is None here, not an identity module.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..errors import UnsupportedModelError
from . import heap, kernels, quant
from .architecture import Architecture

log = logging.getLogger("pc_rag.weights")

PACKED_DTYPES = (torch.float32, torch.bfloat16)
FEW_ROWS = 4  # products of at most this many rows go through kernels.linear_rows where it runs (docstring)
BATCH_ROWS = 8  # and of up to this many where it was faster at this many rows too, timed at load
QUANT_ROWS = 16  # products of at most this many rows read quantized weights straight (docstring's figures)
# Longer products decode this many bytes of a matrix at a time: under heap.MMAP_BYTES, so the buffer comes back from
# malloc's heap at every product instead of as fresh pages (a fault and zeroing each).
QUANT_TILE_BYTES = 16 << 20


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


class _Product:
    """What Packed and Quantized share: a product of a few rows through the kernel (`few`, set in a runner's view),
    and the unsplit product split back into the modules' outputs."""

    few = None
    few_rows = 0
    splits: list[int]

    def takes_few(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes to the kernel (`few`) rather than to oneDNN."""
        return self.few is not None and rows <= self.few_rows

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decoded(self) -> _Product:
        """This product as a caller multiplies several blocks of rows by it in turn (a prefill's MLP): itself where
        its weights are float."""
        return self

    def __call__(self, x: torch.Tensor):
        y = self.product(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return list(y.split(self.splits, -1)) if len(self.splits) > 1 else y


class Packed(_Product):
    """The modules' float weights as one matrix ([out_1 + out_2 + ..., in], row-major), which the modules' own
    weights then view (one copy); the product is split back into one output per module (or into `splits` of a fused
    module's output). Products of at most `few_rows` rows go to `few` (kernels.LinearRows) instead, in a runner's
    view (`routed`), the rest to oneDNN."""

    def __init__(self, modules: list[torch.nn.Module], splits: list[int] | None = None):
        self.weight = _one_matrix(modules)
        biases = [m.bias for m in modules]
        if any(b is not None for b in biases):
            biases = [b.detach() if b is not None else self.weight.new_zeros(m.weight.shape[0])
                      for b, m in zip(biases, modules, strict=True)]
            self.bias = torch.cat(biases)
        else:
            self.bias = None
        self.splits = splits if splits is not None else [m.weight.shape[0] for m in modules]
        self.dtype = self.weight.dtype
        self.kernel: kernels.LinearRows | None = None  # linear_rows over them, in a runner's view (`routed`)
        self.few: kernels.LinearRows | None = None  # `kernel` where it takes a few rows' products, else None
        self.few_rows = 0  # the most rows `few` takes: FEW_ROWS or BATCH_ROWS, as timed at load

    def routed(self, library: kernels.Kernels | None, rows: int) -> Packed:
        """This product sharing its weights, with products of up to `rows` rows through `library`'s linear_rows
        (None: none; rows 0: the kernel kept for the fused step's choice, not used by `product`)."""
        view = copy.copy(self)
        view.kernel = None if library is None else kernels.LinearRows(library.linear_rows, [self.weight], self.bias)
        view.few = view.kernel if rows else None
        view.few_rows = rows if view.kernel is not None else 0
        return view

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, in] (rows contiguous) times the weights, unsplit: [B, out]."""
        if self.takes_few(x.shape[0]) and self.few.fits(x):
            return self.few.run(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _one_matrix(modules: list[torch.nn.Module]) -> torch.Tensor:
    """The modules' weights as one row-major matrix, the modules' own weights made views of it (so the model keeps
    one copy, and sees what pc_rag multiplies by). One module: its weight itself."""
    weights = [m.weight.detach() for m in modules]
    if len(weights) == 1 and weights[0].is_contiguous():
        return weights[0]
    whole = torch.cat(weights) if len(weights) > 1 else weights[0].contiguous()
    at = 0
    for m, w in zip(modules, weights, strict=True):
        m.weight.data = whole[at: at + w.shape[0]]
        at += w.shape[0]
    return whole


class Quantized(_Product):
    """Quantized modules' products (quant.QuantLinear, one input size), their bytes the only copy, concatenated as
    segments of one product and split back like Packed's. Up to `few_rows` rows through `few` (kernels.QuantRows);
    more by oneDNN over the matrices decoded QUANT_TILE_BYTES at a time (by the kernel, or by torch without one)."""

    def __init__(self, modules: list[torch.nn.Module], splits: list[int] | None, dtype: torch.dtype):
        self.modules = modules
        self.formats = [m.format for m in modules]
        self.k = modules[0].in_features
        if any(m.in_features != self.k for m in modules):
            raise UnsupportedModelError(f"quantized modules of {[m.in_features for m in modules]} inputs in one "
                                        "product")
        biases = [m.bias for m in modules]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach().to(dtype) if b is not None else m.qweight.new_zeros(m.out_features, dtype=dtype)
             for b, m in zip(biases, modules, strict=True)])
        self.splits = splits if splits is not None else [m.out_features for m in modules]
        self.n = sum(m.out_features for m in modules)
        self.dtype = dtype
        self.kernel: kernels.QuantRows | None = None
        self.few: kernels.QuantRows | None = None
        self.few_rows = 0

    def routed(self, library: kernels.Kernels | None, rows: int) -> Quantized:
        """This product sharing its bytes, through `library`'s kernels where it runs here (fp32, or bf16 with
        AVX512-BF16, on the CPU): up to QUANT_ROWS rows straight from the bytes, whatever `rows` the float products
        take."""
        view = copy.copy(self)
        runs = (library is not None and self.dtype in kernels.DTYPES and self.modules[0].qweight.device.type == "cpu"
                and (self.dtype == torch.float32 or library.linear_bf16))
        view.kernel = None if not runs else kernels.QuantRows(
            library.quant_rows, library.dequant_rows, [m.qweight for m in self.modules], self.formats, self.k,
            self.bias, self.dtype)
        view.few = view.kernel
        view.few_rows = QUANT_ROWS if view.kernel is not None else 0
        return view

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_few(x.shape[0]) and self.few.fits(x):
            return self.few.run(x)
        tile = max(16, QUANT_TILE_BYTES // (self.k * x.element_size()))
        if tile >= self.n:
            return self._times(x, 0, self.n)
        y = torch.empty(x.shape[0], self.n, dtype=x.dtype, device=x.device)
        for a in range(0, self.n, tile):
            y[:, a: a + tile] = self._times(x, a, min(self.n, a + tile))
        return y

    def decoded(self) -> _Product:
        """The matrices decoded once to the product's dtype (a transient float copy of this product only), for a
        caller that multiplies several blocks of rows by them: decoding per block had cost a 4K-token prefill of the
        0.37B shape ~0.3 s (4 blocks per 2K chunk, fused.after_attention). Itself without the native kernel."""
        if self.kernel is None or not _packs(self.dtype, torch.device("cpu")):
            return self
        view = _Decoded()
        view.weight, view.bias, view.splits = self.kernel.dequantize(), self.bias, self.splits
        return view

    def _times(self, x: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """x times output rows [first, stop) of the product, decoded to x's dtype."""
        bias = None if self.bias is None else self.bias[first:stop]
        if self.kernel is not None and x.dtype == self.dtype and x.device.type == "cpu":
            weight = self.kernel.dequantize(first, stop)
            if _packs(x.dtype, x.device):
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
            return torch.nn.functional.linear(x, weight, bias)
        parts, at = [], 0
        for m in self.modules:  # torch's decoding, on any device
            a, b = max(first, at), min(stop, at + m.out_features)
            if a < b:
                parts.append(quant.dequantize(m.qweight[a - at: b - at], m.format, self.k).to(x.dtype))
            at += m.out_features
        return torch.nn.functional.linear(x, parts[0] if len(parts) == 1 else torch.cat(parts), bias)


class _Decoded(_Product):
    """A Quantized product's matrices decoded for a while (Quantized.decoded): oneDNN over them, no kernel."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


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
    packed: bool  # whether the products are pc_rag's own (Packed, Quantized), not the modules' forwards
    quantized: bool  # whether the decoder's products are Quantized (a GGUF file, or quantize=)
    # few_rows_limit's timings of these weights: id(linear_rows fn) -> (fn, rows, why); shared by the views
    timed: dict = field(default_factory=dict, compare=False, repr=False)

    def routed(self, library: kernels.Kernels | None, rows: int) -> Weights:
        """A runner's view of these (shared) weights: products of up to `rows` rows through `library`'s kernels
        (None for none), the weights themselves shared."""
        if not self.packed:
            return self
        layers = tuple(replace(lw, qkv=lw.qkv.routed(library, rows), o=lw.o.routed(library, rows),
                               gate_up=lw.gate_up.routed(library, rows), down=lw.down.routed(library, rows))
                       for lw in self.layers)
        return replace(self, layers=layers, lm_head=self.lm_head.routed(library, rows))



@functools.cache
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
        if p.device.type == "cpu":
            _own_memory(model)
        pack = _packs(p.dtype, p.device)

        def product(modules: list[torch.nn.Module], splits: list[int] | None):
            quantized = [isinstance(m, quant.QuantLinear) for m in modules]
            if all(quantized):
                return Quantized(modules, splits, p.dtype)
            if pack and not any(quantized):
                return Packed(modules, splits)
            return Plain(modules, splits)  # CUDA, fp16, or float and quantized matrices in one group (rare)

        q_size, kv_size = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
        layers = []
        for i, layer in enumerate(model.model.layers[:num_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [_module(attn, name, arch, i) for name in arch.qkv]
            gate_up = [_module(mlp, name, arch, i) for name in arch.gate_up]
            norms = arch.norms
            layers.append(LayerWeights(
                input_norm=_module(layer, norms.before_attention, arch, i),
                qkv=product(qkv, [q_size, kv_size, kv_size] if len(qkv) == 1 else None),
                q_norm=_module(attn, "q_norm" if arch.qk_norm else None, arch, i),
                k_norm=_module(attn, "k_norm" if arch.qk_norm else None, arch, i),
                o=product([attn.o_proj], None),
                attn_out_norm=_module(layer, norms.after_attention, arch, i),
                mlp_norm=_module(layer, norms.before_mlp, arch, i),
                gate_up=product(gate_up, [_outputs(gate_up[0]) // 2] * 2 if len(gate_up) == 1 else None),
                down=product([mlp.down_proj], None),
                act=_module(mlp, arch.act, arch, i),
                mlp_out_norm=_module(layer, norms.after_mlp, arch, i),
            ))
        head = product([model.lm_head], None)
        products = [*(q for lw in layers for q in (lw.qkv, lw.o, lw.gate_up, lw.down)), head]
        found = Weights(tuple(layers), head, all(not isinstance(q, Plain) for q in products),
                        any(isinstance(q, Quantized) for q in products))
        _SHARED[model] = found
        if p.device.type == "cpu":
            heap.trim()  # the tensors the products' matrices were made from are free
        return found


def _own_memory(model: torch.nn.Module) -> None:
    """Tensors still reading the checkpoint file through a memory map (transformers loads safetensors in their own
    dtype without a copy) copied into the process's memory, so the map goes once they are. Otherwise the pages of
    the file the loaded model read stay resident beside the copies pc_rag makes (q|k|v, gate|up): a float
    checkpoint loaded in its own dtype held 1.6x its weights' bytes (fp32, 0.37B shape, 2026-12-07)."""
    mapped = _file_mappings()
    if not mapped:
        return
    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t is not None and t.device.type == "cpu" and t.numel() and _in(mapped, t.data_ptr()):
                t.data = t.data.clone()


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's memory maps of regular files (Linux /proc/self/maps; elsewhere none)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].rstrip().endswith((".so", ")")) \
                and ".so." not in parts[5]:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end))
    return out


def _in(ranges: list[tuple[int, int]], address: int) -> bool:
    return any(a <= address < b for a, b in ranges)


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's tensors hold (parameters and buffers, each storage counted once: views and tied weights
    share theirs): the weights' memory, float or quantized, as engine.stats() reports it."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _outputs(module: torch.nn.Module) -> int:
    return module.out_features if isinstance(module, quant.QuantLinear) else module.weight.shape[0]


def few_rows_limit(w: Weights, library: kernels.Kernels) -> tuple[int, str]:
    """How many rows' products go to `library`'s linear_rows rather than oneDNN for these float weights, and why:
    0, FEW_ROWS or BATCH_ROWS, as timed (`_few_rows_faster`) once per model and kernel, then kept on `w`."""
    fn = library.linear_rows
    with _SHARED_LOCK:
        if id(fn) not in w.timed:  # (ctypes functions do not hash); the entry keeps `fn` alive, so its id stays its
            view = w.routed(library, FEW_ROWS)
            one, one_why = _few_rows_faster(view, 1)
            if not one:
                rows, why = 0, f"oneDNN: faster for one row at load ({one_why})"
            else:
                batch, batch_why = _few_rows_faster(view, BATCH_ROWS)
                rows = BATCH_ROWS if batch else FEW_ROWS
                why = f"up to {rows} rows, faster at load (1 row: {one_why}; {BATCH_ROWS} rows: {batch_why})"
            w.timed[id(fn)] = (fn, rows, why)
        return w.timed[id(fn)][1:]


def _products(w: Weights) -> list:
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
