"""pc_rag's attention kernels (pc_rag/model/kernels.py, csrc/): decode attention and causal prefill attention, and
the few-row product (linear_rows) against float64 products.

References: attention computed in float64 by sdpa over the same tensors (the kernels within 1e-5 in fp32, within
bf16's rounding in bf16); the attention paths with the kernels against the same paths through sdpa (1e-5, fp32);
the engine's greedy tokens with and without them. Where the kernels cannot run here (not Linux x86-64 with
AVX-512; bf16 prefill: no AVX512-BF16), only the fallback tests run."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pc_rag.model import attention, kernels
from pc_rag.model.attention import Heads

runs_here = kernels._unsupported() is None
needs_kernel = pytest.mark.skipif(not runs_here, reason="the kernel is for Linux x86-64 with AVX-512")


@needs_kernel
def test_the_kernel_builds_and_loads_where_it_should():
    assert kernels.decode_attention_kernel() is not None, "AVX-512 and g++ are here, yet the kernel did not load"
    assert kernels.loaded().prefill is not None
    assert kernels.prefill_attention_kernel(torch.float32) is not None, "the prefill kernel did not load"
    # bf16: the kernel's own AMX tiles where the CPU has them (and Linux grants them), else its dot products
    assert kernels.loaded().prefill_amx == kernels.has_amx()
    assert kernels.prefill_attention_kernel(torch.bfloat16) is not None


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("heads,group,dim", [(4, 2, 64), (2, 7, 64), (8, 1, 128), (1, 4, 256), (2, 3, 16)])
def test_kernel_equals_float64_attention(dtype, tol, heads, group, dim):
    fn, g = kernels.decode_attention_kernel(), torch.Generator().manual_seed(heads * 100 + group * 10 + dim)
    for n in (1, 15, 16, 17, 300, 1100):  # one key, partial 16-lane tails, several chunks per head
        q = torch.randn(heads, group, dim, generator=g).to(dtype)
        k, v = (torch.randn(heads, n, dim, generator=g).to(dtype) for _ in range(2))
        want = F.scaled_dot_product_attention(q[None].double(), k[None].double(), v[None].double(),
                                              scale=dim ** -0.5)[0]
        got = kernels.decode_attention(fn, q[None], [k], [v], dim ** -0.5)[0]
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.double() - want).abs().max().item() < tol, (n, dtype)


@needs_kernel
def test_kernel_reads_slices_of_a_request_buffer_and_large_scores():
    """Keys as the decode step passes them: the first T slots of a [1, H, capacity, D] buffer (heads a capacity
    apart); scores far above exp's range, which the softmax must shift away."""
    fn, g = kernels.decode_attention_kernel(), torch.Generator().manual_seed(3)
    buf_k, buf_v = (torch.randn(1, 2, 700, 32, generator=g) * 30 for _ in range(2))
    q = torch.randn(1, 4, 1, 32, generator=g) * 30
    keys, values = buf_k[:, :, :513], buf_v[:, :, :513]
    want = F.scaled_dot_product_attention(q.double().reshape(1, 2, 2, 32), keys.double(), values.double(),
                                          scale=0.25)
    got = kernels.decode_attention(fn, q.reshape(1, 2, 2, 32), [keys[0]], [values[0]], 0.25)[0]
    assert torch.isfinite(got).all()
    assert (got.double() - want[0]).abs().max().item() < 1e-4 * want.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_one_call_for_several_requests_equals_each_alone(dtype, tol):
    """A batched decode step: requests of different lengths (one key to several chunks) in one call, each
    against float64 attention over its own keys."""
    fn, g = kernels.decode_attention_kernel(), torch.Generator().manual_seed(11)
    lengths = [1, 700, 33, 2048, 16]
    q = torch.randn(len(lengths), 2, 3, 32, generator=g).to(dtype)
    keys = [torch.randn(2, n, 32, generator=g).to(dtype) for n in lengths]
    values = [torch.randn(2, n, 32, generator=g).to(dtype) for n in lengths]
    got = kernels.decode_attention(fn, q, keys, values, 0.2)
    for r in range(len(lengths)):
        want = F.scaled_dot_product_attention(q[r: r + 1].double(), keys[r][None].double(), values[r][None].double(),
                                              scale=0.2)[0]
        assert (got[r].double() - want).abs().max().item() < tol, lengths[r]


@needs_kernel
def test_decode_step_with_the_kernel_equals_sdpa(monkeypatch):
    """`attend_decode` (every decode step) through the kernel against the same call through sdpa."""
    g = torch.Generator().manual_seed(5)
    heads = Heads(2, 0.125)
    q = torch.randn(1, 8, 1, 64, generator=g)
    keys, values = (torch.randn(1, 4, 900, 64, generator=g)[:, :, :811] for _ in range(2))
    with_kernel = attention.attend_decode(q, [keys], [values], heads)
    monkeypatch.setattr(kernels, "_kernel", None)
    without = attention.attend_decode(q, [keys], [values], heads)
    assert (with_kernel - without).abs().max().item() < 1e-5


@needs_kernel
def test_engine_decodes_the_same_tokens_with_and_without_the_kernel(engine, monkeypatch):
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    with_kernel = engine.generate(prompt, max_new_tokens=24)
    monkeypatch.setattr(kernels, "_kernel", None)
    without = engine.generate(prompt, max_new_tokens=24)
    assert list(with_kernel.token_ids) == list(without.token_ids)


def test_a_kernel_that_will_not_build_leaves_sdpa(monkeypatch, tmp_path, caplog):
    """No compiler: one log line, no kernel, and the decode step still runs (through sdpa)."""
    monkeypatch.setattr(kernels, "_kernel", kernels._MISSING)
    monkeypatch.setattr(kernels, "_unsupported", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-pc-rag")
    with caplog.at_level(logging.INFO, logger="pc_rag.kernels"):
        assert kernels.decode_attention_kernel() is None
    assert "no-such-compiler-pc-rag" in caplog.text
    q, keys = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16)
    want = F.scaled_dot_product_attention(q.reshape(1, 2, 2, 16), keys, keys, scale=0.25).reshape(1, 4, 1, 16)
    assert torch.allclose(attention.attend_decode(q, [keys], [keys], Heads(2, 0.25)), want, atol=1e-6)


@needs_kernel
def test_a_broken_cached_library_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A truncated file where the library should be (a disk that filled up, a copy cut short) would crash the
    process that loads it: it is compiled again instead, and the kernel runs."""
    monkeypatch.setattr(kernels, "_kernel", kernels._MISSING)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = kernels._library()  # compiled into the empty folder
    intact = path.read_bytes()
    path.write_bytes(intact[:1000])
    fn = kernels.decode_attention_kernel()
    assert fn is not None and path.read_bytes() == intact
    q, k = torch.randn(1, 2, 16), torch.randn(1, 5, 16)
    want = F.scaled_dot_product_attention(q[None], k[None], k[None], scale=0.25)[0]
    assert torch.allclose(kernels.decode_attention(fn, q[None], [k], [k], 0.25)[0], want, atol=1e-6)


@needs_kernel
def test_a_cache_folder_that_cannot_be_written_still_gets_the_kernel(monkeypatch, tmp_path):
    """$XDG_CACHE_HOME under a file (as unwritable as a read-only home, even for root): built in a temporary
    folder instead, and used."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(kernels, "_kernel", kernels._MISSING)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    assert kernels.decode_attention_kernel() is not None
    assert not (blocker / "cache").exists()


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("PC_RAG_NO_KERNELS", "1")
    assert kernels._unsupported() == "PC_RAG_NO_KERNELS is set"


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_read():
    fn = kernels.decode_attention_kernel()
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernels.decode_attention(fn, torch.randn(1, 1, 1, 16).half(), [torch.randn(1, 4, 16).half()],
                                 [torch.randn(1, 4, 16).half()], 0.25)
    q, k = torch.randn(1, 1, 24), torch.randn(1, 4, 24)  # head_dim not a multiple of 16
    with pytest.raises(RuntimeError, match="refused"):
        kernels.decode_attention(fn, q[None], [k], [k], 0.25)
    assert not attention._kernel_takes(k[None], k[None])


# ---- prefill attention ---------------------------------------------------------------------------------------------
def causal_float64(q, keys, values, scale):
    """q [H, n, D] over keys/values [H_kv, T, D], row i seeing keys [0, T - n + i], in float64: [H, n, D]."""
    n, t, group = q.shape[1], keys.shape[1], q.shape[0] // keys.shape[0]
    visible = torch.ones(n, t, dtype=torch.bool).tril(t - n)
    return F.scaled_dot_product_attention(q[None].double(), keys[None].double().repeat_interleave(group, 1),
                                          values[None].double().repeat_interleave(group, 1), attn_mask=visible,
                                          scale=scale)[0]


@needs_kernel
@pytest.mark.parametrize("dtype,tol,path", [(torch.float32, 1e-5, "best"), (torch.bfloat16, 1.6e-2, "best"),
                                            (torch.bfloat16, 1.6e-2, "dot"), (torch.bfloat16, 1.6e-2, "widened")])
@pytest.mark.parametrize("heads,group,dim", [(4, 2, 64), (2, 7, 64), (2, 1, 128), (1, 2, 256), (3, 1, 16), (2, 2, 96)])
def test_prefill_kernel_equals_float64_attention(dtype, tol, path, heads, group, dim):
    """Rows and keys around the kernel's tiles (12 and 6 rows, 48-row items, 256-key blocks, 32-key score tiles;
    AMX: 16-row items, 16-key panels), alone (a cold prefill) and after earlier keys (a question after a cached
    prefix); q strided as the fused projection's view is. bf16 three ways: as this CPU runs it best (AMX tiles where
    it has them), with AVX512-BF16 dot products, and widened to fp32 (CPUs without AVX512-BF16)."""
    fn, g = kernels.loaded().prefill, torch.Generator().manual_seed(heads * 100 + group * 10 + dim)
    h = heads * group
    for n, t in ((1, 1), (5, 5), (16, 16), (17, 17), (47, 47), (48, 48), (49, 49), (64, 64), (65, 65), (130, 130),
                 (1, 300), (7, 70), (270, 600), (100, 333), (33, 513)):
        fused = torch.randn(n, h + 2 * heads, dim, generator=g).to(dtype)
        q = fused[:, :h].transpose(0, 1)
        keys, values = (torch.randn(heads, t, dim, generator=g).to(dtype) for _ in range(2))
        got = kernels.prefill_attention(fn, q, keys, values, dim ** -0.5, path=path)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.double() - causal_float64(q, keys, values, dim ** -0.5)).abs().max().item() < tol, (n, t)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_prefill_kernel_with_large_scores_and_buffer_slices(dtype, tol):
    """Keys as an "after" forward passes them (the first T slots of a [1, H, capacity, D] buffer) and scores far
    above exp's range, which the online softmax must shift away block after block (bf16: on AMX tiles here where
    the CPU has them)."""
    fn, g = kernels.loaded().prefill, torch.Generator().manual_seed(7)
    buf_k, buf_v = ((torch.randn(1, 2, 900, 32, generator=g) * 30).to(dtype) for _ in range(2))
    q = (torch.randn(4, 90, 32, generator=g) * 30).to(dtype)
    keys, values = buf_k[0, :, :613], buf_v[0, :, :613]
    want = causal_float64(q, keys, values, 0.25)
    got = kernels.prefill_attention(fn, q, keys, values, 0.25)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() < tol * want.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attend_with_the_prefill_kernel_equals_sdpa(dtype, tol, monkeypatch):
    """`attend` for a cold prefill (causal) and for fresh tokens after cached ones (after: few and many) through
    the kernel, against the same calls through sdpa."""
    g = torch.Generator().manual_seed(9)
    heads = Heads(2, 0.125)
    for start, n in ((0, 300), (200, 30), (100, 600)):
        q = torch.randn(1, 8, n, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, 4, n, 64, generator=g).to(dtype) for _ in range(2))
        buffers = [torch.randn(1, 4, start + n + 50, 64, generator=g).to(dtype) for _ in range(2)]
        results = []
        for off in (False, True):
            if off:
                monkeypatch.setattr(kernels, "_kernel", None)
            w = attention.Writes.of(list(range(start, start + n)), dtype, "cpu")
            results.append(attention.attend(*[b.clone() for b in buffers], heads, None, q, k, v, w))
        assert (results[0].float() - results[1].float()).abs().max().item() < tol, (start, n)
        monkeypatch.undo()


@needs_kernel
def test_engine_prefills_the_same_tokens_with_and_without_the_kernels(engine, monkeypatch):
    """Whole prompts recomputed (mode "full"): the same greedy tokens with pc_rag's kernels as with sdpa."""
    prompt = "Attention is computed block by block. " * 40
    with_kernel = engine.generate(prompt, mode="full", max_new_tokens=16)
    monkeypatch.setattr(kernels, "_kernel", None)
    without = engine.generate(prompt, mode="full", max_new_tokens=16)
    assert list(with_kernel.token_ids) == list(without.token_ids)


@needs_kernel
def test_the_prefill_kernel_refuses_what_it_cannot_read():
    fn = kernels.prefill_attention_kernel(torch.float32)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernels.prefill_attention(fn, torch.randn(2, 4, 16).half(), torch.randn(1, 4, 16).half(),
                                  torch.randn(1, 4, 16).half(), 0.25)
    q, k = torch.randn(2, 4, 24), torch.randn(1, 4, 24)  # head_dim not a multiple of 16
    with pytest.raises(RuntimeError, match="refused"):
        kernels.prefill_attention(fn, q, k, k, 0.25)
    with pytest.raises(RuntimeError, match="refused"):  # more query rows than keys
        kernels.prefill_attention(fn, torch.randn(2, 5, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 16), 0.25)
    assert not attention._prefill_kernel_takes(q[None], k[None], k[None])


@needs_kernel
def test_the_prefill_kernel_out_of_memory_is_an_error_not_a_crash():
    """Keys too long to pack (a broadcast row standing for 2^32 keys: 1 TiB to pack) raise MemoryError."""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":  # every allocation succeeds there; packing would then touch 1 TiB
            pytest.skip("this kernel never refuses memory (vm.overcommit_memory = 1)")
    fn = kernels.prefill_attention_kernel(torch.float32)
    keys = torch.randn(1, 1, 64).expand(1, 2**32, 64)
    with pytest.raises(MemoryError, match="packed keys"):
        kernels.prefill_attention(fn, torch.randn(1, 1, 64), keys, keys, 0.125)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("start,n", [(1, 300), (40, 160), (100, 300)])
def test_attention_after_a_short_prefix_equals_the_masked_reference(monkeypatch, dtype, tol, start, n):
    """Fresh rows after a cached prefix where pc_rag's prefill kernel does not run (bf16 on AMX CPUs, CPUs without
    AVX-512, CUDA): a prefix of at most a quarter of them takes one causal call with its rows padded
    (`_attend_padded`), a longer one the masked or two-part path; every way against float64 attention."""
    monkeypatch.setattr(attention, "_prefill_kernel_runs", lambda *a: False)
    monkeypatch.setattr(attention, "_prefill_kernel_takes", lambda *a: False)
    g = torch.Generator().manual_seed(start + n)
    heads, group, dim = 2, 3, 32
    layer_k, layer_v = (torch.randn(1, heads, start + n + 20, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, heads * group, n, dim, generator=g).to(dtype)
    k, v = layer_k[:, :, start: start + n].clone(), layer_v[:, :, start: start + n].clone()
    w = attention.Writes.of(list(range(start, start + n)), dtype, "cpu")
    assert (w.mask is None) == (start * attention.PADDED_PREFIX_SHARE <= n)
    got = attention.attend(layer_k, layer_v, Heads(group, dim ** -0.5), None, q, k, v, w)
    want = causal_float64(q[0], layer_k[0, :, : start + n], layer_v[0, :, : start + n], dim ** -0.5)
    assert got.shape == q.shape
    assert (got[0].double() - want).abs().max().item() < tol


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("k", [16, 40, 896, 1000])
def test_linear_rows_equals_a_float64_product(dtype, tol, k):
    """Rows 1..17 (the kernel takes up to 8 in one pass over the weights, 4 weight rows at a time up to 4 x rows,
    fewer above), segments of 4n and odd row counts, K a multiple of 32 or not, with
    and without a bias, x rows a stride apart (column ranges of a wider tensor); large enough to be threaded."""
    fn = kernels.linear_rows_kernel(dtype)
    if fn is None:
        pytest.skip("no AVX512-BF16 here")
    g = torch.Generator().manual_seed(k)
    ws = [torch.randn(n, k, generator=g).to(dtype) for n in (64, 7, 129)]
    bias = torch.randn(200, generator=g).to(dtype)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17):
        x = torch.randn(m, k + 8, generator=g).to(dtype)[:, 3: 3 + k]
        for b in (None, bias):
            want = F.linear(x.double(), torch.cat(ws).double(), None if b is None else b.double())
            got = kernels.LinearRows(fn, ws, b)(x)
            assert got.dtype == dtype and got.shape == (m, 200)
            # bf16: the fp32 sum rounded once (half an ulp of the output) plus the inputs' own rounding
            assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item(), (m, b is None)
            for r in range(m):  # a row's result does not depend on the rows beside it
                assert torch.equal(kernels.LinearRows(fn, ws, b)(x[r: r + 1])[0], got[r])
