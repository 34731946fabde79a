"""Native CPU kernels pc_rag compiles for itself, once per machine: attention and a decode step's small ops (csrc/).

- decode_attention.cpp: a decode step's attention (one query token per request). sdpa's CPU kernel read the KV
  at about half the machine's rate in fp32 and a third in bf16 (bench model, 4K keys, 8 layers: 4.9 against
  2.9 ms in fp32, 5.7 against 1.4 ms in bf16). `pc_rag_decode_step` runs it straight from the fused q|k|v
  projection, with RoPE and the KV writes (fused.py).
- elementwise.cpp: the residual add with the RMSNorm after it, SiLU(gate) * up, a prefill's RoPE and KV writes
  (fused.py); cached keys rotated to another position (rope.relocate).
- linear_rows.cpp: the product of a few rows by a layer's weights (a decode step's linear layers; weights.py),
  reading the weights at a higher rate than oneDNN's or MKL's one-row products.
- quant_rows.cpp: weights kept in GGML's quantized formats (quant.py): rows decoded to fp32 or bf16 (an
  embedding's, a prefill's products), and the product of a few rows read straight from the quantized bytes, through
  linear_rows' microkernels (rows.h) over rows decoded into a scratch buffer in L2.
- decode_layers.cpp: a decode step's layers in one call, those kernels in a loop (fused.py), so that a step lets
  go of the GIL once instead of at every op.
- prefill_attention.cpp: causal attention of many query rows (a cold prefill, the fresh tokens after a cached
  prefix, or rows at any slots: blend's recomputed rows, text between relocated chunks). sdpa's CPU kernel ran
  its block products through MKL at 60-135 GFLOP/s in both dtypes on the bench machine; register-blocked tiles
  (FMAs in fp32, AVX512-BF16 dot products in bf16) ran 1.5-3x faster, and with a mask sdpa computed every key of
  every row. In bf16 on CPUs with AMX, sdpa runs its products on AMX tiles, and so does the kernel's causal layout
  (faster again: docs/speed.md#prefill).

Where they run: Linux on x86-64 with AVX-512 (what servers have: Intel since Skylake-SP, AMD since Zen 4), keys in
fp32 or bf16, head_dim a multiple of 16 up to 256. The bf16 prefill multiplies in bf16: on AMX tiles where the
CPU has them (Intel since Sapphire Rapids; head_dim a multiple of 32), else with dot products where it has
AVX512-BF16 (Intel since Cooper Lake, AMD since Zen 4), else widened to fp32 as it packs.

The sources are plain C++ with OpenMP and no torch or Python headers, so `g++` (or $CXX) compiles them in a few
seconds, the first time a runner is made on a machine (one line says so while it runs), into $XDG_CACHE_HOME/
pc_rag_kernels (default ~/.cache/pc_rag_kernels), one library per version of the sources and compiler; later
processes load that file, and need no compiler to do so: without one, the newest intact build of these sources
there is loaded (where that folder cannot be written, each process builds into a temporary one). They are called
through ctypes (which lets go of the GIL), on the OpenMP runtime torch already loaded (the same `libgomp.so.1`),
with as many threads as torch's ops. A build goes to a file of its own and is renamed into place, so processes
that build at once never wait on each other; a file that does not match the digest written beside it is rebuilt,
not loaded.

Which operations of a runner use them is the runner's choice (backends.py). Where the library does not load, every
runner takes torch's paths: a WARNING says why, what it costs and how to fix it where the kernels could run but did
not build or load (no compiler and no cached build, a failed build, a kernel that disagreed with sdpa on a probe);
an INFO line where they cannot run (another platform or CPU) or PC_RAG_NO_KERNELS=1 (A/B runs) turns them off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("pc_rag.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "decode_attention.cpp", CSRC / "prefill_attention.cpp", CSRC / "elementwise.cpp",
           CSRC / "linear_rows.cpp", CSRC / "quant_rows.cpp", CSRC / "decode_layers.cpp"]  # one library
HEADERS = [CSRC / "simd.h", CSRC / "rows.h"]
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read keys and values in
PROFILE_NAME = "pc_rag::decode_attention"
PREFILL_PROFILE_NAME = "pc_rag::prefill_attention"
LINEAR_PROFILE_NAME = "pc_rag::linear_rows"
LAYERS_PROFILE_NAME = "pc_rag::decode_layers"
QUANT_PROFILE_NAME = "pc_rag::quant_rows"
# No FMA contraction: the elementwise ops round as torch's separate ops do.
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c++17", "-ffp-contract=off"]

_lock = threading.Lock()
_MISSING = object()
# (the loaded `Kernels` or None where they do not run, why not) once tried: the library loads once per process
_loaded: object = _MISSING

# What the kernels save, for the warning where they do not build (docs/speed.md#native-cpu-kernels).
COST = ("attention runs through torch's sdpa and every op of a decode step through torch: decode steps took 1.3-4x "
        "and a cold prefill 1.4-1.6x the kernels' time on the benchmark model")
FIX = ("install a C++ compiler with OpenMP (g++: `apt-get install g++`, or set $CXX to one) and start again; the "
       "build is cached in {folder}, so later processes load it without a compiler")


@dataclass(frozen=True)
class Kernels:
    """The library's functions (ctypes)."""

    decode: object
    prefill: object
    decode_step: object  # one layer's RoPE, KV write and attention in a decode step
    add_rms_norm: object
    silu_mul: object
    prefill_rope: object  # a prefill layer's RoPE and KV writes
    relocate_keys: object  # cached bf16 keys rotated to another position (rope.relocate)
    linear_rows: object  # a few rows times a layer's weights (weights.Packed)
    linear_bf16: bool  # whether linear_rows takes bf16 here (AVX512-BF16)
    decode_layers: object  # a decode step's layers in one call (fused.py)
    prefill_amx: bool  # whether the prefill kernel runs bf16 on AMX tiles here
    quant_rows: object  # a few rows times quantized weights (weights.Quantized)
    dequant_rows: object  # rows of a quantized matrix decoded (quant.QuantEmbedding, a prefill's products)


class Product(ctypes.Structure):
    """decode_layers.cpp's PcProduct: a LinearRows' (or QuantRows') weights."""

    _fields_ = [("segments", ctypes.c_int64), ("weights", ctypes.c_void_p), ("rows", ctypes.c_void_p),
                ("types", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("outputs", ctypes.c_int64)]

    @classmethod
    def of(cls, lr: LinearRows | QuantRows) -> Product:
        types = ctypes.cast(lr._types, ctypes.c_void_p) if isinstance(lr, QuantRows) else None
        return cls(len(lr.weights), ctypes.cast(lr._ptrs, ctypes.c_void_p), ctypes.cast(lr._rows, ctypes.c_void_p),
                   types, None if lr.bias is None else lr.bias.data_ptr(), lr.n)


class Layer(ctypes.Structure):
    """decode_layers.cpp's PcLayer: one decoder layer's norms and products (pointers into tensors kept elsewhere)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", Product), ("o", Product), ("gate_up", Product),
                ("down", Product), ("window", ctypes.c_int64)]


class Base(ctypes.Structure):
    """decode_attention.cpp's PcBase: a request's shared prefix (cache.SharedPrefix), or none (n = 0)."""

    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("k_layer", ctypes.c_int64),
                ("v_layer", ctypes.c_int64), ("k_head", ctypes.c_int64), ("v_head", ctypes.c_int64),
                ("n", ctypes.c_int64)]

    @classmethod
    def of(cls, base) -> Base:
        if base is None:
            return cls(None, None, 0, 0, 0, 0, 0)
        k, v = base.keys, base.values  # [L, 1, H_kv, n, D]
        return cls(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k.stride(2), v.stride(2), base.n)


def traced(name: str):
    """torch's record_function(name) while a profiler runs (so a profile shows the kernel by name), else nothing:
    entering one costs ~8.5 us even with no profiler, and a decode step makes 5 such calls per layer (1 ms of a 63
    ms step at the large benchmark shape)."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def kernel_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pc_rag_kernels"


def loaded() -> Kernels | None:
    """The compiled kernels, built or loaded on first use in this process, or None where they do not run (`why_not`
    says why). Which of them a runner uses is its own choice (backends.py)."""
    global _loaded
    if _loaded is _MISSING:
        with _lock:
            if _loaded is _MISSING:
                _loaded = _load()
    return _loaded[0]


def why_not() -> str:
    """Why `loaded()` is None ("" where the kernels loaded or were not tried yet)."""
    return "" if _loaded is _MISSING else _loaded[1]


def has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (torch's own check, as vLLM's CPU backend uses it)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else False


class BuildError(OSError):
    """The library could not be built or loaded here (no compiler and no cached build, a failed build)."""


def _load() -> tuple[Kernels | None, str]:
    """(the kernels, "") or (None, why not), having logged why: an INFO line where they cannot run here or are
    switched off, a WARNING (why, what it costs, how to fix it) where they could run but did not build or load."""
    why = _unsupported()
    if why is not None:
        log.info("pc_rag: no native CPU kernels (%s): attention through sdpa, products through oneDNN", why)
        return None, why
    try:
        found = _bind(ctypes.CDLL(str(_library())))
        if _agrees(found):
            return found, ""
        why = "a compiled kernel disagreed with sdpa on a probe; please report it with your CPU's model"
    except Exception as e:  # whatever fails here, torch's paths are always there
        why = f"{e}" if isinstance(e, BuildError) else f"the library did not load: {type(e).__name__}: {e}"
    log.warning("pc_rag's CPU kernels are not used: %s. So %s. To fix: %s.", why, COST,
                FIX.format(folder=kernel_dir()))
    return None, why


def _unsupported() -> str | None:
    if os.environ.get("PC_RAG_NO_KERNELS"):
        return "PC_RAG_NO_KERNELS is set"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"the kernel is for Linux on x86-64, this is {sys.platform} on {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "this CPU has no AVX-512"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "g++")


def _source_key() -> str:
    text = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    return hashlib.sha256(text + f"{FLAGS}".encode()).hexdigest()[:16]


def _library() -> Path:
    """The built library: an intact file for these sources and this compiler, else compiled now; without a
    compiler, the newest intact build of these sources (by any compiler), else BuildError.

    Intact: its bytes hash to the digest written beside it after the build. A truncated or corrupt shared
    library can crash the process that loads it (SIGBUS), so any other file is rebuilt, never loaded."""
    source = _source_key()
    cxx = _compiler()
    if cxx is None:
        cached = _cached_build(kernel_dir(), source)
        if cached is None:
            raise BuildError(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH, and no build of these "
                             f"kernels in {kernel_dir()}")
        return cached
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    compiler = hashlib.sha256(version.encode()).hexdigest()[:8]
    path = _writable(kernel_dir()) / f"kernels-{source}-{compiler}.so"
    if _intact(path):
        return path
    _say(f"pc_rag: compiling pc_rag's CPU kernels, once per machine (a few seconds; {cxx}, into {path.parent})")
    part = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    done = subprocess.run([cxx, *FLAGS, "-o", str(part), *map(str, SOURCES)], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        part.unlink(missing_ok=True)
        raise BuildError(f"{cxx} failed: {done.stderr.strip()[-500:]}")
    digest = _digest(part)
    os.replace(part, path)
    digest_part = path.with_name(part.name + ".sha256")
    digest_part.write_text(digest)
    os.replace(digest_part, path.with_suffix(".sha256"))
    return path


def _intact(path: Path) -> bool:
    digest_file = path.with_suffix(".sha256")
    try:
        return path.exists() and digest_file.exists() and _digest(path) == digest_file.read_text().strip()
    except OSError:
        return False


def _cached_build(folder: Path, source: str) -> Path | None:
    """The newest intact library built from these sources in `folder` (by whichever compiler), or None."""
    try:
        builds = sorted(folder.glob(f"kernels-{source}-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    return next((p for p in builds if _intact(p)), None)


def _say(message: str) -> None:
    """A line the user should see while waiting: on the "pc_rag.kernels" logger where the application set up
    logging, else on stderr (as a progress bar is), since a first build takes seconds."""
    if log.hasHandlers():
        log.info(message)
    else:
        print(message, file=sys.stderr, flush=True)


def _writable(folder: Path) -> Path:
    """`folder`, created if need be, or where it cannot be written (a read-only home) a new temporary folder:
    this process still gets the kernel, at the cost of a build per process."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="pc_rag_kernels_"))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bind(lib: ctypes.CDLL) -> Kernels:
    if not lib.pc_rag_supported():
        raise OSError("this CPU lacks an AVX-512 subset the kernels use")
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    decode = lib.pc_rag_decode_attention_segments
    decode.argtypes = [i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, f32, i64, i32, ptr]
    decode.restype = i32
    prefill = lib.pc_rag_prefill_attention
    prefill.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, i64, i64, i32,
                        f32, i32]
    prefill.restype = i32
    step = lib.pc_rag_decode_step
    step.argtypes = [i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, f32, ptr, ptr, ptr, ptr, i64, ptr, ptr,
                     ptr, i64, ptr, i64, i64, i64, i32, f32, i32, ptr]
    step.restype = i32
    norm = lib.pc_rag_add_rms_norm
    norm.argtypes = [i64, i64, ptr, ptr, ptr, f32, i32, i32, ptr]
    norm.restype = i32
    silu = lib.pc_rag_silu_mul
    silu.argtypes = [i64, i64, ptr, ptr, i64, i32, i32, ptr]
    silu.restype = i32
    rope = lib.pc_rag_prefill_rope
    rope.argtypes = [i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, f32, ptr, ptr, i64, ptr, i64, i64, i64,
                     i64, i32, i32]
    rope.restype = i32
    relocate = lib.pc_rag_relocate_keys
    relocate.argtypes = [i64, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr]
    relocate.restype = i32
    linear = lib.pc_rag_linear_rows
    linear.argtypes = [i64, i64, ptr, i64, i64, ptr, ptr, ptr, i32, i32, ptr, i64]
    linear.restype = i32
    layers = lib.pc_rag_decode_layers
    layers.argtypes = [i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, f32,
                       f32, f32, i32, i32]
    layers.restype = i32
    quant = lib.pc_rag_quant_rows
    quant.argtypes = [i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i32, i32, ptr, i64]
    quant.restype = i32
    dequant = lib.pc_rag_dequant_rows
    dequant.argtypes = [i32, i64, ptr, i64, i64, ptr, i32, i32, ptr, i64]
    dequant.restype = i32
    return Kernels(decode, prefill, step, norm, silu, rope, relocate, linear, bool(lib.pc_rag_linear_bf16_supported()),
                   layers, bool(lib.pc_rag_prefill_amx_supported()), quant, dequant)


def decode_attention(fn, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scale: float, owner: list[int] | None = None) -> torch.Tensor:
    """One decode step's attention for B requests in one call: request r's query rows q[r] [H_kv, G, D] over its
    keys[r] / values[r] [H_kv, n_r, D] (CPU, fp32 or bf16, rows contiguous). Returns [B, H_kv, G, D] in the keys'
    dtype (scores and softmax in fp32, the output rounded once, as sdpa's CPU kernel does). With `owner`, the keys
    are segments, segment s read by request owner[s] (a shared prefix, then the request's own slots), merged.

    The keys go to the threads in chunks of 64-512 rows, small enough that every thread gets about four."""
    dtype = keys[0].dtype
    if dtype not in DTYPES or any(t.dtype != dtype for t in (*keys, *values)):
        raise ValueError(f"decode attention kernel: keys and values in {sorted({str(t.dtype) for t in keys})} "
                         "(fp32 or bf16 only, all alike)")
    b, h, g, d = q.shape
    threads = torch.get_num_threads()
    lengths = [k.shape[1] for k in keys]
    rows = min(512, max(64, -(-sum(lengths) * h // (4 * threads))))
    q = q.to(dtype).contiguous()
    out = torch.empty(q.shape, dtype=dtype)
    segments = len(keys)
    i64n, ptrn = ctypes.c_int64 * segments, ctypes.c_void_p * segments
    with traced(PROFILE_NAME):
        status = fn(b, q.data_ptr(), segments, None if owner is None else i64n(*owner),
                    ptrn(*[k.data_ptr() for k in keys]), ptrn(*[v.data_ptr() for v in values]), i64n(*lengths),
                    i64n(*[k.stride(0) for k in keys]), i64n(*[v.stride(0) for v in values]), h, g, d,
                    int(dtype == torch.bfloat16), scale, rows, threads, out.data_ptr())
    if status != 0:
        raise RuntimeError(f"decode attention kernel refused keys {[tuple(k.shape) for k in keys]}")
    return out


BF16_PATHS = {"best": 1, "widened": 2, "dot": 3}  # pc_rag_prefill_attention's bf16 codes


def prefill_attention(fn, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      path: str = "best", seen: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the query rows q [H_q, n, D] over keys / values [H_kv, T, D], T >= n (CPU, fp32 or
    bf16 alike, D contiguous, heads and rows at any strides): row i sits at slot T - n + i and sees the keys
    [0, T - n + i], or, given `seen` [n] (int64, each in [0, T)), the keys [0, seen[i]] (rows at any slots: the
    bf16 path then never takes AMX tiles). Query head h uses KV head h // (H_q // H_kv). Returns [H_q, n, D] in the
    keys' dtype, a view of a [n, H_q, D] tensor (what the output projection reads). `path` (bf16; tests): "best"
    (AMX tiles where the CPU has them, else AVX512-BF16 dot products, else widened to fp32), "dot" (never AMX) or
    "widened"."""
    h, n, d = q.shape
    hk, t, _ = keys.shape
    dtype = keys.dtype
    if dtype not in DTYPES or q.dtype != dtype or values.dtype != dtype:
        raise ValueError(f"prefill attention kernel: q, keys, values in {q.dtype}, {dtype}, {values.dtype} "
                         "(fp32 or bf16 only, all alike)")
    if seen is not None:
        seen = seen.to(device="cpu", dtype=torch.int64).contiguous()
        if seen.shape != (n,):
            raise ValueError(f"prefill attention kernel: seen {tuple(seen.shape)} for {n} query rows")
    out = torch.empty(n, h, d, dtype=dtype)
    with traced(PREFILL_PROFILE_NAME):
        status = fn(q.data_ptr(), q.stride(0), q.stride(1), keys.data_ptr(), keys.stride(0), keys.stride(1),
                    values.data_ptr(), values.stride(0), values.stride(1), out.data_ptr(), out.stride(1),
                    out.stride(0), n, t, None if seen is None else seen.data_ptr(), h, h // hk, d,
                    BF16_PATHS[path] if dtype == torch.bfloat16 else 0, scale, torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"prefill attention kernel: no memory for the packed keys of {tuple(keys.shape)} "
                          f"({2 * keys.numel() * keys.element_size() / 2**20:.0f} MiB)")
    if status != 0:
        raise RuntimeError(f"prefill attention kernel refused q {tuple(q.shape)}, keys {tuple(keys.shape)} "
                           f"in {dtype} on this CPU")
    return out.transpose(0, 1)


class LinearRows:
    """x [M, K] times `weights` [rows_s, K] (row-major, contiguous, one dtype) concatenated, plus `bias`: [M, sum of
    rows_s] in their dtype (accumulated in fp32, rounded once), through `pc_rag_linear_rows` (fn). The pointer
    arrays are built once: a decode step makes 4 such calls per layer."""

    def __init__(self, fn, weights: list[torch.Tensor], bias: torch.Tensor | None):
        if any(w.dtype != weights[0].dtype or w.shape[1] != weights[0].shape[1] or not w.is_contiguous()
               for w in weights) or (bias is not None and not bias.is_contiguous()):
            raise ValueError(f"linear_rows: weights {[(tuple(w.shape), w.dtype) for w in weights]} do not fit")
        self.fn, self.weights, self.bias = fn, weights, bias  # the tensors kept alive for their pointers
        self.dtype, self.k, self.n = weights[0].dtype, weights[0].shape[1], sum(w.shape[0] for w in weights)
        self._ptrs = (ctypes.c_void_p * len(weights))(*[w.data_ptr() for w in weights])
        self._rows = (ctypes.c_int64 * len(weights))(*[w.shape[0] for w in weights])

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.dim() == 2 and x.shape[1] == self.k and x.stride(1) == 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fits(x):
            raise ValueError(f"linear_rows: x {tuple(x.shape)} {x.dtype} for weights [{self.n}, {self.k}] {self.dtype}")
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The product of an x the caller has checked `fits` (weights.Packed, on a decode step's path)."""
        y = torch.empty(x.shape[0], self.n, dtype=self.dtype)
        with traced(LINEAR_PROFILE_NAME):
            status = self.fn(x.shape[0], self.k, x.data_ptr(), x.stride(0), len(self.weights), self._ptrs, self._rows,
                             None if self.bias is None else self.bias.data_ptr(), int(self.dtype == torch.bfloat16),
                             torch.get_num_threads(), y.data_ptr(), y.stride(0))
        if status != 0:
            raise RuntimeError(f"linear_rows kernel refused {self.dtype} on this CPU")
        return y


class QuantRows:
    """x [M, K] times quantized matrices (`weights`: uint8 [rows_s, row bytes] in GGML formats `formats`, one K)
    concatenated, plus `bias` (in x's dtype): [M, sum of rows_s] in `dtype` (fp32 or bf16), through
    `pc_rag_quant_rows` (fn); `dequantize` decodes them whole (or some of their rows) through `pc_rag_dequant_rows`
    (fn_rows). Each output equals linear_rows' product by the decoded weights (quant_rows.cpp)."""

    def __init__(self, fn, fn_rows, weights: list[torch.Tensor], formats: list, k: int, bias: torch.Tensor | None,
                 dtype: torch.dtype):
        if any(w.dtype != torch.uint8 or not w.is_contiguous() or w.shape[1] != f.row_bytes(k)
               for w, f in zip(weights, formats, strict=True)) or dtype not in DTYPES:
            shapes = [(tuple(w.shape), f.name) for w, f in zip(weights, formats, strict=True)]
            raise ValueError(f"quant_rows: weights {shapes} for {k} inputs in {dtype} do not fit")
        self.fn, self.fn_rows, self.weights, self.formats, self.bias = fn, fn_rows, weights, formats, bias
        self.dtype, self.k, self.n = dtype, k, sum(w.shape[0] for w in weights)
        self._ptrs = (ctypes.c_void_p * len(weights))(*[w.data_ptr() for w in weights])
        self._rows = (ctypes.c_int64 * len(weights))(*[w.shape[0] for w in weights])
        self._types = (ctypes.c_int * len(weights))(*[f.ggml_type for f in formats])

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.dim() == 2 and x.shape[1] == self.k and x.stride(1) == 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fits(x):
            raise ValueError(f"quant_rows: x {tuple(x.shape)} {x.dtype} for weights [{self.n}, {self.k}] {self.dtype}")
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.n, dtype=self.dtype)
        with traced(QUANT_PROFILE_NAME):
            status = self.fn(x.shape[0], self.k, x.data_ptr(), x.stride(0), len(self.weights), self._ptrs, self._rows,
                             self._types, None if self.bias is None else self.bias.data_ptr(),
                             int(self.dtype == torch.bfloat16), torch.get_num_threads(), y.data_ptr(), y.stride(0))
        if status != 0:
            raise RuntimeError(f"quant_rows kernel refused {[f.name for f in self.formats]} in {self.dtype} here")
        return y

    def dequantize(self, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """The decoded weights' rows [first, stop) of the concatenation: [rows, K] in `dtype`."""
        stop = self.n if stop is None else stop
        out = torch.empty(stop - first, self.k, dtype=self.dtype)
        at = 0
        for w, f in zip(self.weights, self.formats, strict=True):
            a, b = max(first, at), min(stop, at + w.shape[0])
            if a < b:
                dequant_rows(self.fn_rows, w[a - at: b - at], f, self.k, None, out[a - first: b - first])
            at += w.shape[0]
        return out


def dequant_rows(fn, weight: torch.Tensor, fmt, k: int, index: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Rows `index` (int64; None: all) of the quantized matrix `weight` (uint8, rows contiguous) decoded into `out`
    [rows, k] (fp32 or bf16, rows contiguous) through `pc_rag_dequant_rows` (fn). Returns `out`."""
    if index is not None:
        index = index.to(torch.int64).contiguous()
    n = weight.shape[0] if index is None else index.numel()
    status = fn(fmt.ggml_type, k, weight.data_ptr(), weight.stride(0), n, None if index is None else index.data_ptr(),
                int(out.dtype == torch.bfloat16), torch.get_num_threads(), out.data_ptr(), out.stride(0))
    if status != 0:
        raise RuntimeError(f"dequant_rows kernel refused {fmt.name} rows of {k} weights")
    return out


def _agrees(k: Kernels) -> bool:
    """Each kernel against sdpa (or F.linear) on a probe per dtype it runs: the decode kernel over keys in several
    chunks, 2 query rows per KV head; the prefill kernel over 100 rows after 200 earlier keys (partial tiles and
    blocks); linear_rows over two weight segments, one of them not a multiple of 4 rows."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(2, 2, 64, generator=g).to(dtype)
        keys = torch.randn(2, 300, 64, generator=g).to(dtype)
        values = torch.randn(2, 300, 64, generator=g).to(dtype)
        want = torch.nn.functional.scaled_dot_product_attention(q[None], keys[None], values[None], scale=0.125)[0]
        if not torch.allclose(decode_attention(k.decode, q[None], [keys], [values], 0.125)[0].float(), want.float(),
                              rtol=tol, atol=tol):
            return False
        q = torch.randn(4, 100, 64, generator=g).to(dtype)
        visible = torch.ones(100, 300, dtype=torch.bool).tril(200)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=visible, scale=0.125, enable_gqa=True)[0]
        if not torch.allclose(prefill_attention(k.prefill, q, keys, values, 0.125).float(), want.float(), rtol=tol,
                              atol=tol):
            return False
        if dtype == torch.float32 or k.linear_bf16:
            x = torch.randn(3, 40, generator=g).to(dtype)
            ws = [torch.randn(8, 40, generator=g).to(dtype), torch.randn(5, 40, generator=g).to(dtype)]
            bias = torch.randn(13, generator=g).to(dtype)
            want = torch.nn.functional.linear(x.float(), torch.cat(ws).float(), bias.float())
            if not torch.allclose(LinearRows(k.linear_rows, ws, bias)(x).float(), want, rtol=tol, atol=tol):
                return False
    return True
