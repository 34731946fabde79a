"""The standard decoder layer's small ops as native calls between the matrix products: a whole decode step, and
in a prefill the norms and the MLP's activation.

A decode step is memory and per-op overhead (docs/speed.md): between its four products a layer ran ~35 small
torch ops (two RMSNorms of 6-8 ops each in bf16, RoPE on queries and keys, the per-request KV writes and views,
SiLU, the residual adds), each a dispatch of 3-10 us, plus the Python between them; at the large benchmark shape
(24 layers) that was 13 of a 44 ms step. vLLM's CPU engine runs the same layer as fused C++ ops. Here, per layer:

    x = RMSNorm(h)                      pc_rag_add_rms_norm (fused with the previous residual add)
    qkv = x Wqkv                        weights.Packed: pc_rag_linear_rows (a few rows), oneDNN (more);
                                        weights.Quantized: pc_rag_quant_rows (up to 16 rows)
    o = attention(RoPE(q), cache + k, v)  pc_rag_decode_step: RoPE, the KV written to each request's slot, attention
    h += o Wo; x = RMSNorm(h)           weights.Packed; pc_rag_add_rms_norm
    a = SiLU(x Wg) * (x Wu)             weights.Packed; pc_rag_silu_mul
    h += a Wd                           weights.Packed; fused into the next layer's norm

Where every product of the step goes to linear_rows or quant_rows (a few rows, `few_rows`), that loop over the
layers runs as one native call (csrc/decode_layers.cpp: the same kernels in the same order, so the same sums), and
a step lets go of the GIL once instead of at each of ~20 ops per layer (docs/speed.md#decode).

A prefill (runner.forward_layers) takes the same norm and SiLU calls, threaded over its rows, and RoPE with the KV
writes in one call (pc_rag_prefill_rope): in bf16 torch ran them as fp32 round trips (to, pow, mean, rsqrt, mul, to,
mul per norm; silu then mul; cat, neg, mul, mul, add per RoPE, then copies), 2.4 of a 10.5 s cold 4K prefill at the
large shape. Attention stays attention.py's.

Which models: the layer of Llama, Mistral, Qwen2, Qwen3 and the families that share it (a pre-attention and a
pre-MLP RMSNorm, per-head q/k RMSNorms or none, SiLU, rotate-half RoPE over the whole head, no multipliers or
soft-caps), in fp32 or bf16 where the runner chose the native kernels for decode attention (backends.py) and the
products are packed. Each op rounds where the model's own ops do, and `FusedLayers.of` checks a probe prefill and
step against the module-by-module ones before it is used: any family, version or norm that differs gets the
module-by-module layers (runner.py), as does everything else. Its answer is the runner's `layers` backend.
"""

from __future__ import annotations

import ctypes
import time

import torch

from . import kernels
from .architecture import DEFAULT_ROPE, Norms
from .backends import FUSED, KERNEL, MODULES, Choice

# A prefill's MLP runs at most this many bytes of gate|up product at a time (FusedLayers.after_attention).
MLP_BYTES = 16 << 20


def _eps(norm: torch.nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _is_silu(act) -> bool:
    # transformers' ACT2FN["silu"] is its own SiLUActivation class, nn.SiLU elsewhere; the probe checks the rest.
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


class FusedLayers:
    """One runner's fused ops (see the module docstring); `of(runner)` builds them, or says why they do not apply."""

    def __init__(self, runner, k: kernels.Kernels):
        self.runner = runner
        self.k = k
        w, arch = runner.weights, runner.arch
        self.input_norms = [lw.input_norm.weight.detach().contiguous() for lw in w.layers]
        self.mlp_norms = [lw.mlp_norm.weight.detach().contiguous() for lw in w.layers]
        self.eps = _eps(w.layers[0].input_norm)
        # Qwen3's per-head q/k RMSNorms (None elsewhere), applied by the step before RoPE.
        self.q_norms = [lw.q_norm.weight.detach().contiguous() if lw.q_norm is not None else None for lw in w.layers]
        self.k_norms = [lw.k_norm.weight.detach().contiguous() if lw.k_norm is not None else None for lw in w.layers]
        self.qk_eps = _eps(w.layers[0].q_norm) if w.layers[0].q_norm is not None else 0.0
        self.windows = [layer.window or 0 for layer in arch.layers]
        self.bf16 = int(runner.dtype == torch.bfloat16)
        self.kv_heads, self.head_dim = arch.kv_heads, arch.head_dim
        self.group = arch.heads // arch.kv_heads
        self.mlp_width = w.layers[0].gate_up.splits[0]  # the MLP's intermediate size
        # The step's layers in one native call (decode_layers.cpp) where every product would go to linear_rows.
        self._products = [p for lw in w.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        self._layers = None
        self.native = True  # False: the Python loop (tests compare the two)
        if all(getattr(p, "kernel", None) is not None for p in self._products):
            self._layers = (kernels.Layer * len(w.layers))(*[kernels.Layer(
                self.input_norms[i].data_ptr(), self.mlp_norms[i].data_ptr(), _ptr(self.q_norms[i]),
                _ptr(self.k_norms[i]), *(kernels.Product.of(p.kernel) for p in (lw.qkv, lw.o, lw.gate_up, lw.down)),
                self.windows[i]) for i, lw in enumerate(w.layers)])

    @classmethod
    def of(cls, runner) -> tuple[FusedLayers | None, Choice, str | None]:
        """The runner's fused layers, or None where they do not apply, as its `layers` backend; and where a step of
        BATCH_ROWS requests was timed faster as one native call (`_time_batches`), in words (else None)."""
        why, batches = cls._unfit(runner), None
        if why is None:
            fused = cls(runner, runner.backends.kernels)
            runner._fused = fused  # the probe runs the runner's own forward with it
            try:
                why = fused._disagrees()
                if why is None:
                    batches = fused._time_batches()
            finally:
                runner._fused = None
        if why is not None:
            return None, Choice(MODULES, why), None
        native = ("one native call per step where linear_rows takes every product, else native calls per op"
                  if fused._layers is not None else "native calls per op")
        return fused, Choice(FUSED, f"the standard layer: norms, RoPE, KV writes, attention and SiLU as {native}; "
                             "checked against the module-by-module layers at load"), batches

    @staticmethod
    def _unfit(runner) -> str | None:
        arch, w = runner.arch, runner.weights
        if runner.backends.decode_attention.backend != KERNEL:
            return f"decode attention is {runner.backends.decode_attention.backend}'s, not the native kernel's"
        if runner.device.type != "cpu" or runner.dtype not in kernels.DTYPES or not w.packed:
            return "fused decoding needs fp32/bf16 on CPU with packed products"
        if (arch.norms != Norms() or arch.qk_norm not in (None, "head") or arch.residual_multiplier is not None
                or runner.heads.softcap is not None or arch.head_dim % 16 or arch.head_dim > 256):
            return f"{arch.model_type}'s layer is not the standard one"
        if any(layer.rope != DEFAULT_ROPE for layer in arch.layers) or len(arch.rope_types) != 1:
            return f"{arch.model_type}'s layers do not all use one RoPE table"
        for lw in w.layers:
            if (lw.input_norm is None or lw.mlp_norm is None or not _is_silu(lw.act)
                    or _eps(lw.input_norm) is None or _eps(lw.input_norm) != _eps(lw.mlp_norm)
                    or _eps(lw.input_norm) != _eps(w.layers[0].input_norm)):
                return f"{arch.model_type}'s norms or activation are not the standard ones"
            if arch.qk_norm == "head" and (_eps(lw.q_norm) is None or _eps(lw.q_norm) != _eps(lw.k_norm)
                                           or _eps(lw.q_norm) != _eps(w.layers[0].q_norm)):
                return f"{arch.model_type}'s q/k norms are not the standard ones"
        return None

    def _disagrees(self) -> str | None:
        """A probe: 6 tokens prefilled into two caches, module by module and fused, then one step each way; the
        logits of both must agree as closely as fp32 (1e-4) or bf16 (one rounding of the logits) allow. Returns why
        not, or None. The caller has set runner._fused to self."""
        r = self.runner
        ids = [min(i + 3, r.config.vocab_size - 1) for i in range(7)]
        caches = [r.new_cache(8), r.new_cache(8)]
        six = list(range(6))
        try:
            pairs = [(r.forward_layers(caches[0], ids[:6], six, six, fused=False),
                      r.forward_layers(caches[1], ids[:6], six, six))]
            pairs.append((r.decode_batch(caches[:1], ids[6:], [6], [6], fused=False),
                          self.step(caches[1:], ids[6:], [6], [6])))
        except RuntimeError as e:  # e.g. RoPE over part of each head (Phi-3)
            return f"the fused layers do not take this model: {e}"
        tol = 1e-4 if r.dtype == torch.float32 else 5e-2
        for want, got in pairs:
            scale = float(want.abs().max()) + 1e-6
            if not (((got - want).abs().max() / scale) <= tol and torch.equal(got.argmax(-1), want.argmax(-1))):
                return "a probe disagreed with the module-by-module layers"
        return None

    @torch.inference_mode()
    def _time_batches(self) -> str | None:
        """Where linear_rows' products of BATCH_ROWS rows lost to oneDNN's when timed alone (few_rows_limit),
        whether a step of that many requests is still faster as one native call over them than as the Python loop
        over oneDNN's; if so, the layers' products take that many rows. The native call saves the loop's per-op
        cost: bf16, bench model, 8 requests, 10.7 against 12.1 ms a step, where the products alone lost. Timed once
        per runner at load on empty caches (alternating, medians of 5); returns what it found, in words (None:
        not timed)."""
        from .weights import BATCH_ROWS, FEW_ROWS

        rows = BATCH_ROWS
        if self._layers is None or any(p.few is None or p.few_rows != FEW_ROWS for p in self._products):
            return None
        r = self.runner
        caches = [r.new_cache(16) for _ in range(rows)]
        ids = [min(i + 3, r.config.vocab_size - 1) for i in range(rows)]
        times: dict[int, list[float]] = {FEW_ROWS: [], rows: []}
        for i in range(14):
            limit = (FEW_ROWS, rows)[i % 2]
            for p in self._products:
                p.few_rows = limit
            t = time.perf_counter()
            self.step(caches, ids, [i] * rows, [i] * rows)
            if i >= 4:  # after two of each
                times[limit].append(time.perf_counter() - t)
        loop, native = (sorted(times[k])[2] for k in (FEW_ROWS, rows))
        for p in self._products:
            p.few_rows = rows if native < loop else FEW_ROWS
        return (f"{rows}-request steps {'as one native call' if native < loop else 'through oneDNN'} (one native "
                f"call over linear_rows {native * 1e3:.2f} ms, the layer loop over oneDNN {loop * 1e3:.2f} ms)")

    @torch.inference_mode()
    def step(self, caches, ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """runner.decode_batch's step (same arguments, same result within float rounding), fused. The caller holds
        the runner's lock."""
        r, k = self.runner, self.k
        b, dev = len(ids), r.device
        hidden = r._embed(torch.tensor(ids, device=dev)[:, None])[:, 0].contiguous()  # [B, hidden]; updated in place
        cos, sin = r._rope_at(hidden[:, None], torch.tensor(positions, device=dev)[:, None])[DEFAULT_ROPE]
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()  # [B, D]
        if cos.shape[-1] != self.head_dim or cos.dtype != r.dtype:
            raise RuntimeError(f"fused decode: RoPE tables of {tuple(cos.shape)} {cos.dtype}, heads of {self.head_dim}")
        i64s, ptrs = ctypes.c_int64 * b, ctypes.c_void_p * b
        kbase = ptrs(*[c.keys.data_ptr() for c in caches])
        vbase = ptrs(*[c.values.data_ptr() for c in caches])
        k_layer, v_layer = i64s(*[c.keys.stride(0) for c in caches]), i64s(*[c.values.stride(0) for c in caches])
        k_head, v_head = i64s(*[c.keys.stride(2) for c in caches]), i64s(*[c.values.stride(2) for c in caches])
        slot = i64s(*[s - c.offset for c, s in zip(caches, slots, strict=True)])  # in each buffer's own slots
        # shared prefixes, read in place (cache.py); None where no request has one
        bases = ((kernels.Base * b)(*[kernels.Base.of(c.base) for c in caches])
                 if any(c.base is not None for c in caches) else None)
        threads, eps, bf16 = torch.get_num_threads(), self.eps, self.bf16
        hk, g, d = self.kv_heads, self.group, self.head_dim
        n_hidden, layers = hidden.shape[-1], r.weights.layers
        if self._native(b):  # the loop below in one native call (decode_layers.cpp)
            with kernels.traced(kernels.LAYERS_PROFILE_NAME):
                status = k.decode_layers(b, n_hidden, hidden.data_ptr(), len(layers), self._layers, cos.data_ptr(),
                                         sin.data_ptr(), kbase, vbase, k_layer, v_layer, k_head, v_head, slot, bases,
                                         hk, g, d, eps, self.qk_eps, r.heads.scaling, bf16, threads)
            if status != 0:
                raise RuntimeError(f"fused decode step refused its layers (slots {slots})")
        else:
            x = torch.empty_like(hidden)
            o = torch.empty(b, hk * g * d, dtype=r.dtype)
            k.add_rms_norm(b, n_hidden, hidden.data_ptr(), None, self.input_norms[0].data_ptr(), eps, bf16, threads,
                           x.data_ptr())
            for i, lw in enumerate(layers):
                q = kk = v = lw.qkv.product(x)  # one product: three column ranges of its rows
                kk, v = kk[:, hk * g * d:], v[:, (hk * g + hk) * d:]
                with kernels.traced(kernels.PROFILE_NAME):
                    status = k.decode_step(b, q.data_ptr(), q.stride(0), kk.data_ptr(), kk.stride(0), v.data_ptr(),
                                           v.stride(0), cos.data_ptr(), sin.data_ptr(), d, _ptr(self.q_norms[i]),
                                           _ptr(self.k_norms[i]), self.qk_eps, kbase, vbase, k_layer, v_layer, i,
                                           k_head, v_head, slot, self.windows[i], bases, hk, g, d, bf16,
                                           r.heads.scaling, threads, o.data_ptr())
                if status != 0:
                    raise RuntimeError(f"fused decode step refused layer {i} (slots {slots})")
                self._norm(hidden, lw.o.product(o), self.mlp_norms[i], x)
                gate = up = lw.gate_up.product(x)
                up = up[:, up.shape[-1] // 2:]
                a = torch.empty(b, up.shape[-1], dtype=r.dtype)
                k.silu_mul(b, a.shape[-1], gate.data_ptr(), up.data_ptr(), gate.stride(0), bf16, threads,
                           a.data_ptr())
                self._norm(hidden, lw.down.product(a), self.input_norms[i + 1] if i + 1 < len(layers) else None, x)
        logits = r._logits(hidden[:, None])[:, 0]  # [B, vocab]
        for cache, s in zip(caches, slots, strict=True):
            cache.length = max(cache.length, s + 1)
        return logits.float()

    def _native(self, rows: int) -> bool:
        """Whether a step of `rows` requests runs its layers in one native call: where every product would go to
        linear_rows or quant_rows (`takes_few`, the test Packed.product and Quantized.product make)."""
        return (self._layers is not None and self.native
                and all(p.takes_few(rows) for p in self._products))

    def first_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first layer's input norm of a prefill's hidden states [1, n, hidden]."""
        x = torch.empty_like(hidden)
        self.k.add_rms_norm(hidden.numel() // hidden.shape[-1], hidden.shape[-1], hidden.data_ptr(), None,
                            self.input_norms[0].data_ptr(), self.eps, self.bf16, torch.get_num_threads(), x.data_ptr())
        return x

    def qkv_written(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    parts: list[tuple[object, int, int, int]]) -> list[tuple[torch.Tensor, ...]]:
        """Layer `i`'s queries, keys and values for a prefill's normed rows x [1, n, hidden], in parts: (cache,
        start, first row, rows) writes rows [first, first + rows) to slots [start, start + rows) of cache. For each
        part, the keys (RoPE applied) and values written to its cache there, and the queries returned with RoPE
        applied ([1, H, rows, D], contiguous: sdpa's layout), with the keys and values as views of the cache ([1,
        H_kv, rows, D]). runner._qkv's ops and attention.attend's writes: one product for every part, then one
        native call per part; cos, sin: [1, n, D]."""
        lw, n, d = self.runner.weights.layers[i], x.shape[1], self.head_dim
        q, k, v = (t.view(n, -1) for t in lw.qkv(x))  # column ranges of one product
        cos, sin = cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous()
        if cos.dtype != q.dtype:
            raise RuntimeError(f"fused prefill: RoPE tables in {cos.dtype}, projections in {q.dtype}")
        out = []
        for cache, start, a, m in parts:
            queries = torch.empty(1, self.kv_heads * self.group, m, d, dtype=q.dtype)
            keys, values = cache.keys[i, :, :, start: start + m], cache.values[i, :, :, start: start + m]
            self.k.prefill_rope(m, q[a].data_ptr(), q.stride(0), k[a].data_ptr(), k.stride(0), v[a].data_ptr(),
                                v.stride(0), cos[a].data_ptr(), sin[a].data_ptr(), d, _ptr(self.q_norms[i]),
                                _ptr(self.k_norms[i]), self.qk_eps, queries.data_ptr(), keys.data_ptr(),
                                keys.stride(1), values.data_ptr(), values.stride(1), self.kv_heads, self.group, d,
                                self.bf16, torch.get_num_threads())
            out.append((queries, keys, values))
        return out

    def after_attention(self, i: int, hidden: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of layer `i` in a prefill, runner._after_attention's ops with the norms and SiLU fused: `hidden`
        [1, n, hidden] (contiguous) += o Wo, then += the MLP of its norm, in place. Returns the next layer's input
        norm of it (after the last layer: nothing to use).

        The MLP runs MLP_BYTES of its widest activations at a time: a whole 4K-token prefill's gate|up product is
        80-160 MB, which the allocator maps fresh for every layer (glibc maps blocks over 32 MB, and a fresh page
        costs a fault and zeroing: 20-40 ms per 80 MB here), while blocks under that are reused from its heap."""
        lw, bf16, threads = self.runner.weights.layers[i], self.bf16, torch.get_num_threads()
        width = hidden.shape[-1]
        out = lw.o(o.transpose(1, 2).reshape(-1, width))
        hidden = hidden.view(-1, width)
        x = self._norm(hidden, out, self.mlp_norms[i], torch.empty_like(hidden))
        after = None if i + 1 == len(self.input_norms) else self.input_norms[i + 1]
        # A power of two: at the large shape in bf16 (AMX), oneDNN's down product (4864 -> 896) ran at 1,551
        # GFLOP/s over 512 rows and 1,747 over 2,048, but 811 over 768 (1,024: 803); a 4K prefill took 2.94-3.57
        # against 3.19-3.51 s with 512-row blocks instead of 768 (docs/speed.md#prefill). Measured at that shape only.
        budget = MLP_BYTES // (2 * self.mlp_width * hidden.element_size())
        rows = max(256, 1 << max(0, budget.bit_length() - 1))
        gate_up, down = lw.gate_up, lw.down
        if hidden.shape[0] > rows:  # quantized weights decoded once for all the blocks, not once per block
            gate_up, down = gate_up.decoded(), down.decoded()
        for a in range(0, hidden.shape[0], rows):
            gate, up = gate_up(x[a: a + rows])  # [r, I] each: column ranges of one product
            act = torch.empty(gate.shape, dtype=gate.dtype)
            self.k.silu_mul(gate.shape[0], gate.shape[1], gate.data_ptr(), up.data_ptr(), gate.stride(0), bf16,
                            threads, act.data_ptr())
            self._norm(hidden[a: a + rows], down(act), after, x[a: a + rows])  # x's rows a.. are used up
        return x.view(1, -1, width)

    def _norm(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
              out: torch.Tensor) -> torch.Tensor:
        """hidden += delta, then out = RMSNorm(hidden) * weight (just the add where weight is None); rows of any
        leading shape, contiguous."""
        self.k.add_rms_norm(hidden.numel() // hidden.shape[-1], hidden.shape[-1], hidden.data_ptr(), delta.data_ptr(),
                            None if weight is None else weight.data_ptr(), self.eps, self.bf16,
                            torch.get_num_threads(), out.data_ptr())
        return out
