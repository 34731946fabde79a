"""Which code runs each operation of a runner's forwards, chosen once when the runner is built, with why.

One `Backends` per LlamaRunner (`LlamaRunner.backends`), passed to the operations that read it (attention.py,
rope.py, fused.py, the products in weights.py), never looked up in a module global: a runner built with
`native=False` runs torch's paths for real, beside a runner over the same model that runs the kernels.

| operation | backends | chosen by |
|---|---|---|
| `decode_attention` (one query token per request) | kernel, sdpa, eager (soft-capped logits) | `choose` |
| `prefill_attention` (many query rows, causal) | kernel, sdpa, eager | `choose` |
| `relocation` (cached keys rotated to another position) | kernel (bf16), torch | `choose` |
| `products` (the linear layers) | oneDNN (one copy of the weights), modules (F.linear, cuBLAS) | the runner |
| `few_rows` (products of a decode step's few rows) | linear_rows (up to 4 or 8 rows), as `products` | timed at load |

Quantized weights (weights.Quantized) have their own `products` (dequantized+oneDNN: decoded a tile at a time by
the native kernel, then oneDNN; torch: decoded by torch, then F.linear) and `few_rows` (quant_rows up to 16 rows,
or torch's as `products`).
| `layers` (a layer's small ops between products) | fused (native calls), modules | a probe at load (fused.py) |

The native kernels (kernels.py) are one library: where it does not load (another platform, no compiler and no
cached build, `PC_RAG_NO_KERNELS=1`) or the runner is told not to use it, every operation takes torch's path, and
each choice says why. `as_dict()` is what `engine.stats()["backends"]` reports; `summary()` the INFO line a runner
logs when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kernels

KERNEL, SDPA, EAGER, TORCH, ONEDNN, MODULES, LINEAR_ROWS, FUSED = (
    "kernel", "sdpa", "eager", "torch", "oneDNN", "modules", "linear_rows", "fused")
QUANT, QUANT_ROWS_BACKEND = "dequantized+oneDNN", "quant_rows"  # quantized weights' products (weights.Quantized)


@dataclass(frozen=True)
class Choice:
    """What runs an operation (`backend`, one of the names above) and why that one."""

    backend: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"backend": self.backend, "why": self.why}


NOT_CHOSEN = Choice(MODULES, "not chosen: no runner chose it (attention and relocation alone)")


@dataclass(frozen=True)
class Backends:
    """One runner's choice per operation (see the module docstring), and the native kernels it calls."""

    decode_attention: Choice
    prefill_attention: Choice
    relocation: Choice
    products: Choice = NOT_CHOSEN
    few_rows: Choice = NOT_CHOSEN
    layers: Choice = NOT_CHOSEN
    kernels: kernels.Kernels | None = field(default=None, repr=False, compare=False)

    @property
    def decode_kernel(self):
        """pc_rag_decode_attention (ctypes) where decode attention is the kernel's, else None."""
        return self.kernels.decode if self.decode_attention.backend == KERNEL else None

    @property
    def prefill_kernel(self):
        """pc_rag_prefill_attention (ctypes) where prefill attention is the kernel's, else None."""
        return self.kernels.prefill if self.prefill_attention.backend == KERNEL else None

    @property
    def relocate_kernel(self):
        """pc_rag_relocate_keys (ctypes) where relocation is the kernel's, else None."""
        return self.kernels.relocate_keys if self.relocation.backend == KERNEL else None

    def as_dict(self) -> dict[str, dict[str, str]]:
        """{operation: {"backend": ..., "why": ...}} (engine.stats()["backends"])."""
        return {name: getattr(self, name).as_dict() for name in OPERATIONS}

    def summary(self) -> str:
        """The choices in one line: "decode attention kernel, prefill attention sdpa, ..."."""
        return ", ".join(f"{name.replace('_', ' ')} {getattr(self, name).backend}" for name in OPERATIONS)


OPERATIONS = ("decode_attention", "prefill_attention", "products", "few_rows", "layers", "relocation")


def unfit(dtype: torch.dtype, device, head_dim: int) -> str | None:
    """Why the native kernels cannot run a model of this dtype, device and head size, or None."""
    if torch.device(device).type != "cpu":
        return f"the native kernels are CPU-only; this model is on {torch.device(device).type}"
    if dtype not in kernels.DTYPES:
        return f"the native kernels read fp32 or bf16; this model is {_name(dtype)}"
    if head_dim % 16 or head_dim > 256:
        return f"the native kernels take head_dim a multiple of 16 up to 256; this model's is {head_dim}"
    return None


def choose(dtype: torch.dtype, softcap: bool, library: kernels.Kernels | None, why_not: str = "") -> Backends:
    """The attention and relocation backends for a model of this dtype (`softcap`: its attention logits are
    soft-capped, Gemma 2), given the native `library` that fits it (`unfit`), or None for the reason `why_not`.
    The products, few rows and layers are the runner's to choose (they need its weights); they stay NOT_CHOSEN."""
    if softcap:
        eager = ("soft-capped attention logits (Gemma 2): HF's eager ops, as the model's own forward (sdpa and the "
                 "kernels have no soft-cap)")
        decode = prefill = Choice(EAGER, eager)
    elif library is None:
        decode = prefill = Choice(SDPA, why_not)
    else:
        decode = Choice(KERNEL, "reads the KV at the machine's rate; sdpa's CPU kernel read it at about half in fp32 "
                        "and a third in bf16 (bench model, 8 layers over 4K keys: 2.9 against 4.9 ms fp32, 1.4 "
                        "against 5.7 bf16)")
        prefill = _prefill(dtype, library)
    if library is None:
        relocation = Choice(TORCH, why_not)
    elif dtype != torch.bfloat16:
        relocation = Choice(TORCH, f"{_name(dtype)}: torch's ops write the rotated keys straight into the buffer, as "
                            "fast as the kernel")
    else:
        relocation = Choice(KERNEL, "bf16: the same roundings as torch's ops without fp32 temporaries (0.3 against "
                            "1.2 ms for 8 layers of a 256-token chunk, bench model)")
    return Backends(decode, prefill, relocation, kernels=library)


def without_kernels(why: str) -> Backends:
    """Torch's paths for attention and relocation (no native kernel), for the reason `why`."""
    return choose(torch.float32, False, None, why)


def _prefill(dtype: torch.dtype, library: kernels.Kernels) -> Choice:
    if dtype == torch.float32:
        return Choice(KERNEL, "fp32: register-blocked tiles ran 1.5-3x sdpa's CPU kernel, whose block products go "
                      "to MKL (bench model's heads, one layer of 4K tokens: 62-72 against 138-224 ms)")
    if library.prefill_amx:
        return Choice(KERNEL, "bf16 on AMX tiles, as sdpa's CPU kernel runs it here, and faster (a bench-model "
                      "layer of 4K tokens: 27-28 against 36-37 ms)")
    if kernels.has_amx():
        return Choice(SDPA, "bf16 on a CPU with AMX where the kernel cannot use its tiles: sdpa runs its products "
                      "on them (55 against the kernel's 152 ms for a bench-model layer of 4K tokens)")
    return Choice(KERNEL, "bf16 by AVX512-BF16 dot products (or widened to fp32 where the CPU lacks them): sdpa's "
                  "CPU kernel was no faster in bf16 than in fp32 (38-47 against 133-137 ms, a 4K-token layer)")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
