"""pc_rag's decode-attention kernel (pc_rag/model/kernels.py, csrc/decode_attention.cpp).

References: attention computed in float64 by sdpa over the same tensors (the kernel within 1e-5 in fp32, within
bf16's rounding of the output in bf16); the decode path with the kernel against the same path through sdpa
(1e-5, fp32); the engine's greedy tokens with and without it. Where the kernel cannot run here (not Linux
x86-64 with AVX-512), only the fallback tests run."""

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
