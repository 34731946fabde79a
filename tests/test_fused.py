"""The fused layers (pc_rag/model/fused.py, csrc/elementwise.cpp, pc_rag_decode_step): the decode step and a
prefill's norms, SiLU and RoPE with its KV writes.

References: the module-by-module step and prefill (`decode_batch(..., fused=False)`, `forward_layers(...,
fused=False)`: the model's own modules and sdpa-checked attention) for the logits (fp32 <= 1e-5 relative to the
largest logit; bf16 <= 3e-2 and the same argmax) and for the KV written into each request's cache (a step's: fp32
<= 1e-6, bf16 bit-equal: RoPE rounds as HF's three ops do); torch's and HF's own ops for the elementwise kernels;
HF's `generate` for the tokens (test_families.py already runs every family, the fused ones through this code)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model import kernels, weights
from pc_rag.store import MemoryStore
from pc_rag.testing import build_tiny

from .test_batch import _clone, _prefilled
from .test_kernels import needs_kernel
from .test_models import _save_variant

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]


def _engine(path, dtype):
    return pc_rag.Engine.from_pretrained(path, store=MemoryStore(), dtype=dtype)


@contextlib.contextmanager
def _kernel_products(engine, dtype, rows: int):
    """Every packed product through linear_rows for up to `rows` rows, whichever the timing at load picked (restored
    after); a skip where linear_rows does not take `dtype` on this CPU."""
    if engine.runner.backends.kernels is None or (dtype == torch.bfloat16 and not kernels.loaded().linear_bf16):
        pytest.skip("no AVX512-BF16 here: bf16 products stay oneDNN's")
    products = weights._products(engine.runner.weights)
    keep = [(p.few, p.few_rows) for p in products]
    for p in products:
        p.few, p.few_rows = p.kernel, rows
    try:
        yield
    finally:
        for p, (few, few_rows) in zip(products, keep, strict=True):
            p.few, p.few_rows = few, few_rows


def _step_both_ways(engine, docs, rows: int):
    """`rows` requests of different lengths prefilled, then one step fused and one module by module, each on its
    own copy of the caches: (fused logits, their caches, reference logits, their caches, slots)."""
    runner = engine.runner
    prompts = [[Text(f"Q{i}. "), Chunk(docs[i % len(docs)][: 100 + 90 * i])] for i in range(rows)]
    asms = _prefilled(engine, prompts)
    ids = [int(a.logits.argmax()) for a in asms]
    positions = [a.last_position + 1 for a in asms]
    slots = [a.prompt_tokens for a in asms]
    got_caches = [_clone(runner, a.cache) for a in asms]
    want_caches = [_clone(runner, a.cache) for a in asms]
    got = runner.decode_batch(got_caches, ids, positions, slots)
    want = runner.decode_batch(want_caches, ids, positions, slots, fused=False)
    for a in asms:
        runner.release_cache(a.cache)
    return got, got_caches, want, want_caches, slots


@needs_kernel
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_the_fused_step_equals_the_module_by_module_step(tmp_path, tiny_path, docs, arch, dtype, tol):
    """Llama's layer, Mistral's sliding window (the variant's window is shorter than the prompts) and Qwen2's
    q/k/v biases; one request and four at once."""
    path = tiny_path if arch == "llama" else _save_variant(tmp_path, tiny_path, arch)
    engine = _engine(path, dtype)
    assert engine.runner._fused is not None, "the standard layer should run fused where the kernels run"
    for rows in (1, 4):
        got, got_caches, want, want_caches, slots = _step_both_ways(engine, docs, rows)
        assert got.shape == want.shape and got.dtype == torch.float32
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= tol * scale, (rows, dtype)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for g, w, s in zip(got_caches, want_caches, slots, strict=True):
            assert g.length == w.length == s + 1
            for a, b in ((g.keys, w.keys), (g.values, w.values)):
                new_a, new_b = a[:, :, :, s].float(), b[:, :, :, s].float()  # the step's own KV, every layer
                if dtype == torch.bfloat16:
                    assert torch.equal(new_a, new_b)
                else:
                    assert (new_a - new_b).abs().max().item() <= 1e-6 * new_b.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_qwen3s_per_head_norms_run_fused(tmp_path, docs, dtype, tol):
    engine = _engine(build_tiny(tmp_path / "qwen3", "qwen3"), dtype)
    assert engine.runner._fused is not None
    for rows in (1, 3):
        got, got_caches, want, want_caches, slots = _step_both_ways(engine, docs, rows)
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for g, w, s in zip(got_caches, want_caches, slots, strict=True):
            assert (g.keys[:, :, :, s].float() - w.keys[:, :, :, s].float()).abs().max().item() <= (
                1e-6 if dtype == torch.float32 else 0) * w.keys[:, :, :, s].float().abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_a_step_of_up_to_few_rows_multiplies_by_the_kernel_and_more_rows_by_onednn(tiny_path, docs, dtype, tol):
    """Steps of 1..FEW_ROWS requests read the modules' weights through pc_rag_linear_rows, more rows oneDNN's
    packed ones (the limit set here, not the one timed at load): both must give what the module-by-module step
    gives, and a request's logits must not depend on which of the two its batch size took (within the dtype's
    rounding)."""
    engine = _engine(tiny_path, dtype)
    with _kernel_products(engine, dtype, weights.FEW_ROWS):
        got, _, want, _, _ = _step_both_ways(engine, docs, weights.FEW_ROWS + 1)
        alone, _, _, _, _ = _step_both_ways(engine, docs, 1)
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    assert (alone[0] - got[0]).abs().max().item() <= tol * got[0].abs().max().item()
    assert torch.equal(alone[0].argmax(), got[0].argmax())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_layer_loop_equals_the_python_one(tiny_path, docs, dtype):
    """A step's layers in one native call (decode_layers.cpp) run the Python loop's kernels in its order: the same
    logits and KV bit for bit, for one request, three and BATCH_ROWS."""
    engine = _engine(tiny_path, dtype)
    fused = engine.runner._fused
    with _kernel_products(engine, dtype, weights.BATCH_ROWS):
        for rows in (1, 3, weights.BATCH_ROWS):
            assert fused._native(rows)
            got, got_caches, _, _, slots = _step_both_ways(engine, docs, rows)
            fused.native = False
            try:
                want, want_caches, _, _, _ = _step_both_ways(engine, docs, rows)
            finally:
                fused.native = True
            assert torch.equal(got, want), rows
            for g, w, s in zip(got_caches, want_caches, slots, strict=True):
                assert torch.equal(g.keys[:, :, :, : s + 1], w.keys[:, :, :, : s + 1])
                assert torch.equal(g.values[:, :, :, : s + 1], w.values[:, :, :, : s + 1])
        assert not fused._native(weights.BATCH_ROWS + 1)  # more rows: oneDNN's products, the Python loop


@needs_kernel
def test_one_token_forwards_go_through_the_fused_step_and_equal_it(engine, docs):
    """`forward` with one token (a lone request's decode) is the fused step: bit-equal to decode_batch of one."""
    runner = engine.runner
    asm = _prefilled(engine, [[Text("Q. "), Chunk(docs[0][:200])]])[0]
    token, pos, slot = int(asm.logits.argmax()), asm.last_position + 1, asm.prompt_tokens
    one = runner.forward(_clone(runner, asm.cache), [token], [pos], [slot])
    batched = runner.decode_batch([_clone(runner, asm.cache)], [token], [pos], [slot])[0]
    unfused = runner.decode_batch([_clone(runner, asm.cache)], [token], [pos], [slot], fused=False)[0]
    runner.release_cache(asm.cache)
    assert torch.equal(one, batched)
    assert (one - unfused).abs().max().item() <= 1e-5 * unfused.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3"])
def test_other_layers_keep_the_module_by_module_step(tmp_path, family):
    """Post-norms, q/k norms, partial RoPE, multipliers, NoPE layers: not the fused layer, refused before use."""
    engine = pc_rag.Engine.from_pretrained(build_tiny(tmp_path / family, family), store=MemoryStore())
    assert engine.runner._fused is None


@needs_kernel
def test_the_engine_generates_the_same_tokens_fused_and_not(engine, docs):
    prompt = [Text("Question: what is a frame? "), Chunk(docs[1][:400])]
    fused = engine.generate(prompt, mode="full", max_new_tokens=12).token_ids
    keep, engine.runner._fused = engine.runner._fused, None
    try:
        plain = engine.generate(prompt, mode="full", max_new_tokens=12).token_ids
    finally:
        engine.runner._fused = keep
    assert list(fused) == list(plain)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_and_silu_mul_equal_torch(dtype):
    k, g = kernels.loaded(), torch.Generator().manual_seed(5)
    bf16 = int(dtype == torch.bfloat16)
    for rows, n in ((1, 48), (3, 896), (8, 17), (70, 1000)):  # the last two: tails, and rows over 2 threads
        x, delta = (torch.randn(rows, n, generator=g).mul(3).to(dtype) for _ in range(2))
        w = torch.randn(n, generator=g).to(dtype)
        want_x = x + delta
        h = want_x.float()
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)  # LlamaRMSNorm's ops
        want = w * normed
        out = torch.empty_like(x)
        assert k.add_rms_norm(rows, n, x.data_ptr(), delta.data_ptr(), w.data_ptr(), 1e-6, bf16, 2,
                              out.data_ptr()) == 0
        assert torch.equal(x, want_x)  # the residual add, in place
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the sum of squares' order may move one rounding
        assert (out.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
        gate_up = torch.randn(rows, 2 * n, generator=g).mul(4)
        gate_up[0, :6] = torch.tensor([-200.0, -100.0, -90.0, 90.0, 100.0, 200.0])  # exp's range ends
        gate_up = gate_up.to(dtype)
        want = F.silu(gate_up[:, :n]) * gate_up[:, n:]
        out = torch.empty(rows, n, dtype=dtype)
        gate, up = gate_up[:, :n], gate_up[:, n:]  # the halves of one fused product, rows 2n apart
        assert k.silu_mul(rows, n, gate.data_ptr(), up.data_ptr(), 2 * n, bf16, 2, out.data_ptr()) == 0
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert (out.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_fused_prefill_equals_the_module_by_module_prefill(tmp_path, tiny_path, docs, monkeypatch, arch, dtype,
                                                               tol):
    """A cold prefill (causal) and more tokens after it (the fresh tokens after a cached prefix), fused and module
    by module, each into its own cache: the logits, and every layer's KV (fp32 <= 1e-5 relative; bf16 within the
    roundings the norms' other sum order moves, compounded over the layers). The MLP in blocks of 256 rows
    (MLP_BYTES made small)."""
    from pc_rag.model import fused as fused_module

    monkeypatch.setattr(fused_module, "MLP_BYTES", 1)
    if arch == "llama":
        path = tiny_path
    elif arch == "qwen3":
        path = build_tiny(tmp_path / "qwen3", "qwen3")
    else:
        path = _save_variant(tmp_path, tiny_path, arch)
    runner = _engine(path, dtype).runner
    assert runner._fused is not None
    cold, more = 600, 100
    ids = runner.tokenizer(" ".join(docs) * 2, add_special_tokens=False)["input_ids"][: cold + more]
    assert len(ids) == cold + more
    caches = [runner.new_cache(cold + more), runner.new_cache(cold + more)]
    for a, b in ((0, cold), (cold, cold + more)):
        span = list(range(a, b))
        got = runner.forward_layers(caches[0], ids[a:b], span, span)
        want = runner.forward_layers(caches[1], ids[a:b], span, span, fused=False)
        assert (got - want).abs().max().item() <= tol * want.abs().max().item(), (a, b)
        assert torch.equal(got.argmax(), want.argmax())
    kv_tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in ((caches[0].keys, caches[1].keys), (caches[0].values, caches[1].values)):
        g, w = g[..., : cold + more, :].float(), w[..., : cold + more, :].float()
        assert (g - w).abs().max().item() <= kv_tol * w.abs().max().item()
        first = 1e-6 if dtype == torch.float32 else 1e-2  # layer 0: the embeddings through one norm and RoPE
        assert (g[0] - w[0]).abs().max().item() <= first * w[0].abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_forward_over_several_requests_runs_fused(tmp_path, tiny_path, docs, arch, dtype, tol):
    """`forward_rows` (the decode loop's step with newcomers): three requests' next 1, 9 and 30 tokens after
    prefixes of 40, 300 and 120, fused (one product over the 40 rows, RoPE and KV writes per request) and module
    by module, each on its own copies of the caches: every request's logits, and the KV written."""
    path = tiny_path if arch == "llama" else _save_variant(tmp_path, tiny_path, arch)
    runner = _engine(path, dtype).runner
    assert runner._fused is not None
    ids = runner.tokenizer(" ".join(docs) * 2, add_special_tokens=False)["input_ids"]
    heads, tails = [40, 300, 120], [1, 9, 30]
    got_caches, want_caches, feeds, spans = [], [], [], []
    for b, (n, k) in enumerate(zip(heads, tails, strict=True)):
        cache = runner.new_cache(n + k)
        runner.forward_layers(cache, ids[b: b + n], list(range(n)), list(range(n)))
        got_caches.append(cache)
        want_caches.append(_clone(runner, cache))
        feeds.append(ids[b + n: b + n + k])
        spans.append(list(range(n, n + k)))
    got = runner.forward_rows(got_caches, feeds, spans, spans)
    want = runner.forward_rows(want_caches, feeds, spans, spans, fused=False)
    assert got.shape == want.shape == (3, runner.config.vocab_size)
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    kv_tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w, span in zip(got_caches, want_caches, spans, strict=True):
        for a, r in ((g.keys, w.keys), (g.values, w.values)):
            a, r = a[..., span[0]: span[-1] + 1, :].float(), r[..., span[0]: span[-1] + 1, :].float()
            assert (a - r).abs().max().item() <= kv_tol * r.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,qk_norm", [(64, False), (128, True), (48, False)])
def test_prefill_rope_equals_hfs_ops(dtype, head_dim, qk_norm):
    """pc_rag_prefill_rope against HF's apply_rotary_pos_emb (and Qwen3's per-head RMSNorm): the queries, and the
    keys and values written into a cache at slots 5.., bit for bit without the norms (each product and the sum
    rounded as HF's three ops); 48-dim heads take the scalar path."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    k, g = kernels.loaded(), torch.Generator().manual_seed(7)
    n, hk, group, d = 300, 2, 3, head_dim
    proj = torch.randn(n, (hk * group + 2 * hk) * d, generator=g).mul(2).to(dtype)
    q, kk, v = proj.split([hk * group * d, hk * d, hk * d], -1)
    angles = torch.randn(n, d // 2, generator=g).mul(50)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    norm_w = [torch.randn(d, generator=g).to(dtype) for _ in range(2)] if qk_norm else [None, None]
    heads_q, heads_k = (t.view(1, n, -1, d).transpose(1, 2) for t in (q, kk))
    if qk_norm:
        def norm(x, w):
            h = x.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        heads_q, heads_k = norm(heads_q, norm_w[0]), norm(heads_k, norm_w[1])
    want_q, want_k = apply_rotary_pos_emb(heads_q, heads_k, cos[None], sin[None])
    out = torch.empty(1, hk * group, n, d, dtype=dtype)
    cache_k, cache_v = torch.zeros(1, hk, n + 9, d, dtype=dtype), torch.zeros(1, hk, n + 9, d, dtype=dtype)
    ptr = [None if w is None else w.data_ptr() for w in norm_w]
    assert k.prefill_rope(n, q.data_ptr(), q.stride(0), kk.data_ptr(), kk.stride(0), v.data_ptr(), v.stride(0),
                          cos.data_ptr(), sin.data_ptr(), d, ptr[0], ptr[1], 1e-6, out.data_ptr(),
                          cache_k[0, 0, 5].data_ptr(), cache_k.stride(1), cache_v[0, 0, 5].data_ptr(),
                          cache_v.stride(1), hk, group, d, int(dtype == torch.bfloat16), 2) == 0
    got_k, got_v = cache_k[:, :, 5: 5 + n], cache_v[:, :, 5: 5 + n]
    assert torch.equal(got_v, v.view(1, n, hk, d).transpose(1, 2))
    assert not cache_k[:, :, :5].any() and not cache_k[:, :, 5 + n:].any()  # nothing written outside the slots
    for got, want in ((out, want_q), (got_k, want_k)):
        if qk_norm:  # the sum of squares' order may move one rounding
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
        else:
            assert torch.equal(got, want)
