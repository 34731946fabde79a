"""pc_rag's attention kernels (pc_rag/model/kernels.py, csrc/): decode attention and causal prefill attention, and
the few-row product (linear_rows) against float64 products.

References: attention computed in float64 by sdpa over the same tensors (the kernels within 1e-5 in fp32, within
bf16's rounding in bf16); the attention paths with the kernels against the same paths through sdpa (1e-5, fp32);
the engine's greedy tokens from a runner that chose the kernels against one built without them (`native=False`,
which calls none: a spy counts). Where the kernels cannot run here (not Linux x86-64 with AVX-512; bf16 prefill:
no AVX512-BF16), only the fallback tests run."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import pc_rag
from pc_rag.model import LlamaRunner, attention, backends, kernels
from pc_rag.model.attention import Heads
from pc_rag.store import MemoryStore

runs_here = kernels._unsupported() is None
needs_kernel = pytest.mark.skipif(not runs_here, reason="the kernel is for Linux x86-64 with AVX-512")
NO_KERNELS = backends.without_kernels("the tests' reference")


def with_kernels(dtype=torch.float32) -> backends.Backends:
    """Attention and relocation as a runner of `dtype` chooses them here, with the process's kernels."""
    return backends.choose(dtype, False, kernels.loaded(), kernels.why_not())


@needs_kernel
def test_the_kernel_builds_and_loads_where_it_should():
    assert kernels.loaded() is not None, f"AVX-512 and g++ are here, yet the kernels did not load: {kernels.why_not()}"
    # bf16: the kernel's own AMX tiles where the CPU has them (and Linux grants them), else its dot products
    assert kernels.loaded().prefill_amx == kernels.has_amx()
    for dtype in (torch.float32, torch.bfloat16):
        chosen = with_kernels(dtype)
        assert chosen.decode_kernel is not None and chosen.prefill_kernel is not None, chosen
        assert (chosen.relocate_kernel is not None) == (dtype == torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("heads,group,dim", [(4, 2, 64), (2, 7, 64), (8, 1, 128), (1, 4, 256), (2, 3, 16)])
def test_kernel_equals_float64_attention(dtype, tol, heads, group, dim):
    fn, g = kernels.loaded().decode, torch.Generator().manual_seed(heads * 100 + group * 10 + dim)
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
    fn, g = kernels.loaded().decode, torch.Generator().manual_seed(3)
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
    fn, g = kernels.loaded().decode, torch.Generator().manual_seed(11)
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
def test_decode_step_with_the_kernel_equals_sdpa():
    """`attend_decode` (every decode step) through the kernel against the same call through sdpa."""
    g = torch.Generator().manual_seed(5)
    heads = Heads(2, 0.125)
    q = torch.randn(1, 8, 1, 64, generator=g)
    keys, values = (torch.randn(1, 4, 900, 64, generator=g)[:, :, :811] for _ in range(2))
    with_kernel = attention.attend_decode(q, [keys], [values], heads, with_kernels())
    without = attention.attend_decode(q, [keys], [values], heads, NO_KERNELS)
    assert (with_kernel - without).abs().max().item() < 1e-5


def sdpa_engine(loaded) -> pc_rag.Engine:
    """An engine over the session's model whose runner calls no native kernel: torch's sdpa and oneDNN."""
    engine = pc_rag.Engine(*loaded, store=MemoryStore())
    engine.runner.choose_backends(native=False)
    assert engine.runner.backends.decode_attention.backend == "sdpa" and engine.runner._fused is None
    assert engine.stats()["backends"]["prefill_attention"]["backend"] == "sdpa"
    return engine


def uses_the_kernels(engine) -> None:
    chosen = engine.stats()["backends"]
    assert chosen["decode_attention"]["backend"] == chosen["prefill_attention"]["backend"] == "kernel", chosen
    assert chosen["layers"]["backend"] == "fused", chosen


@needs_kernel
def test_engine_decodes_the_same_tokens_with_and_without_the_kernel(engine, loaded):
    """Greedy tokens of an engine that decodes through the kernels (fused step, decode attention) against an engine
    over the same model that runs none of them: a wrong kernel changes the tokens, and a kernel rejected at load
    (by its probe) fails the first assertion."""
    uses_the_kernels(engine)
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    with_kernel = engine.generate(prompt, max_new_tokens=24)
    without = sdpa_engine(loaded).generate(prompt, max_new_tokens=24)
    assert list(with_kernel.token_ids) == list(without.token_ids)


def spied(library: kernels.Kernels, calls: collections.Counter) -> kernels.Kernels:
    """`library` with every function counting its calls in `calls` (by field name)."""
    def spy(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    return dataclasses.replace(library, **{f.name: spy(f.name, getattr(library, f.name))
                                           for f in dataclasses.fields(library)
                                           if not isinstance(getattr(library, f.name), bool)})


@needs_kernel
def test_a_runner_calls_the_kernels_it_chose_and_no_other(loaded, monkeypatch):
    """The choice is the runner's and every operation reads it: a runner built with native=False calls no native
    function (not even the process's library, spied here), one given the library calls its prefill, fused-layer
    and product kernels. Their logits agree (fp32, 1e-4 of the largest) with the same greedy tokens."""
    model, tok = loaded
    assert kernels.loaded() is not None, f"the kernels did not load here: {kernels.why_not()}"
    calls: collections.Counter = collections.Counter()
    library = spied(kernels.loaded(), calls)
    monkeypatch.setattr(kernels, "_loaded", (library, ""))  # where a runner finds the process's library
    ids = tok("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]
    runs = {}
    for native in (False, library):
        calls.clear()
        runner = LlamaRunner(model, tok, native=native)
        cache, n = runner.new_cache(len(ids) + 8), len(ids)
        logits = [runner.forward(cache, ids, list(range(n)), list(range(n)))]
        for i in range(6):
            token = int(logits[-1].argmax())
            logits.append(runner.forward(cache, [token], [n + i], [n + i]))
        runs[native is False] = torch.stack(logits)
        if native is False:
            assert not calls, calls
        else:
            assert calls["prefill"] and calls["linear_rows"] and calls["decode_layers"] + calls["decode_step"], calls
    without, with_kernels_ = runs[True], runs[False]
    assert (with_kernels_ - without).abs().max().item() <= 1e-4 * without.abs().max().item()
    assert torch.equal(with_kernels_.argmax(-1), without.argmax(-1))


def test_a_kernel_that_will_not_build_leaves_sdpa(monkeypatch, tmp_path, caplog, loaded):
    """No compiler and no cached build: one WARNING (why, what it costs, how to fix it), no kernel, and a runner
    that says why and still decodes (through sdpa)."""
    monkeypatch.setattr(kernels, "_loaded", kernels._MISSING)
    monkeypatch.setattr(kernels, "_unsupported", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-pc-rag")
    with caplog.at_level(logging.INFO, logger="pc_rag.kernels"):
        assert kernels.loaded() is None
    [warning] = [r for r in caplog.records if r.name == "pc_rag.kernels"]
    assert warning.levelno == logging.WARNING
    for words in ("no C++ compiler (no-such-compiler-pc-rag)", "decode steps took", "install a C++ compiler",
                  str(tmp_path)):
        assert words in warning.getMessage()
    assert "no-such-compiler-pc-rag" in kernels.why_not()
    runner = LlamaRunner(*loaded)
    assert runner.backends.decode_attention == backends.Choice("sdpa", kernels.why_not())
    q, keys = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16)
    want = F.scaled_dot_product_attention(q.reshape(1, 2, 2, 16), keys, keys, scale=0.25).reshape(1, 4, 1, 16)
    assert torch.allclose(attention.attend_decode(q, [keys], [keys], Heads(2, 0.25), runner.backends), want,
                          atol=1e-6)


@needs_kernel
def test_the_first_build_says_so_and_a_cached_build_loads_without_a_compiler(monkeypatch, tmp_path, caplog):
    """A build into an empty cache folder logs one line while it compiles; then a process with no compiler loads
    that build (and says nothing of compiling)."""
    monkeypatch.setattr(kernels, "_loaded", kernels._MISSING)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="pc_rag.kernels"):
        assert kernels.loaded() is not None
    assert "compiling pc_rag's CPU kernels, once per machine" in caplog.text
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), CXX="no-such-compiler-pc-rag")
    code = "from pc_rag.model import kernels; print(kernels.loaded() is not None, repr(kernels.why_not()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "''"], (done.stdout, done.stderr)
    assert "compiling" not in done.stderr and "WARNING" not in done.stderr.upper()


@needs_kernel
def test_a_broken_cached_library_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A truncated file where the library should be (a disk that filled up, a copy cut short) would crash the
    process that loads it: it is compiled again instead, and the kernel runs."""
    monkeypatch.setattr(kernels, "_loaded", kernels._MISSING)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = kernels._library()  # compiled into the empty folder
    intact = path.read_bytes()
    path.write_bytes(intact[:1000])
    assert kernels.loaded() is not None and path.read_bytes() == intact
    fn = kernels.loaded().decode
    q, k = torch.randn(1, 2, 16), torch.randn(1, 5, 16)
    want = F.scaled_dot_product_attention(q[None], k[None], k[None], scale=0.25)[0]
    assert torch.allclose(kernels.decode_attention(fn, q[None], [k], [k], 0.25)[0], want, atol=1e-6)


@needs_kernel
def test_a_cache_folder_that_cannot_be_written_still_gets_the_kernel(monkeypatch, tmp_path):
    """$XDG_CACHE_HOME under a file (as unwritable as a read-only home, even for root): built in a temporary
    folder instead, and used."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(kernels, "_loaded", kernels._MISSING)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    assert kernels.loaded() is not None
    assert not (blocker / "cache").exists()


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("PC_RAG_NO_KERNELS", "1")
    assert kernels._unsupported() == "PC_RAG_NO_KERNELS is set"


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_read():
    fn = kernels.loaded().decode
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
@pytest.mark.parametrize("dtype,tol,path", [(torch.float32, 1e-5, "best"), (torch.bfloat16, 1.6e-2, "best"),
                                            (torch.bfloat16, 1.6e-2, "widened")])
@pytest.mark.parametrize("heads,group,dim", [(2, 4, 64), (1, 1, 128), (3, 1, 16)])
def test_prefill_kernel_rows_at_any_slots_equal_float64_attention(dtype, tol, path, heads, group, dim):
    """Rows at scattered slots (blend's recomputed rows, text between relocated chunks), each seeing the keys up to
    its own slot: a 48-row item whose rows reach into different 256-key blocks, a row that sees only key 0,
    slots out of order, every slot (= a cold prefill), and one row at the last key."""
    fn, g = kernels.loaded().prefill, torch.Generator().manual_seed(heads * 100 + group * 10 + dim)
    h = heads * group
    for t, slots in ((600, sorted(torch.randperm(600, generator=g)[:130].tolist())),
                     (300, [0] + list(range(250, 299))), (70, [69, 3, 40, 0, 12]), (97, list(range(97))),
                     (513, [512])):
        n = len(slots)
        q = torch.randn(n, h + 2 * heads, dim, generator=g).to(dtype)[:, :h].transpose(0, 1)
        keys, values = (torch.randn(heads, t, dim, generator=g).to(dtype) for _ in range(2))
        index = torch.tensor(slots)
        visible = torch.arange(t)[None, :] <= index[:, None]
        want = F.scaled_dot_product_attention(q[None].double(), keys[None].double().repeat_interleave(group, 1),
                                              values[None].double().repeat_interleave(group, 1), attn_mask=visible,
                                              scale=dim ** -0.5)[0]
        got = kernels.prefill_attention(fn, q, keys, values, dim ** -0.5, path=path, seen=index)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.double() - want).abs().max().item() < tol, (t, slots[:5])


@needs_kernel
def test_prefill_kernel_refuses_slots_outside_its_keys():
    fn = kernels.loaded().prefill
    q, k = torch.randn(2, 3, 16), torch.randn(1, 8, 16)
    for bad in ([0, 8, 2], [0, -1, 2]):
        with pytest.raises(RuntimeError, match="refused"):
            kernels.prefill_attention(fn, q, k, k, 0.25, seen=torch.tensor(bad))
    with pytest.raises(ValueError, match="seen"):
        kernels.prefill_attention(fn, q, k, k, 0.25, seen=torch.tensor([0, 1]))


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
def test_attend_with_the_prefill_kernel_equals_sdpa(dtype, tol):
    """`attend` for a cold prefill (causal), for fresh tokens after cached ones (after: few and many) and for
    rows at scattered slots (text between relocated chunks; blend's rows: few, and past sdpa's row blocks)
    through the kernel, against the same calls through sdpa."""
    g = torch.Generator().manual_seed(9)
    heads = Heads(2, 0.125)
    scattered = [sorted(torch.randperm(700, generator=g)[:m].tolist()) for m in (40, 600)]
    for slots in [list(range(s, s + n)) for s, n in ((0, 300), (200, 30), (100, 600))] + scattered:
        n = len(slots)
        q = torch.randn(1, 8, n, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, 4, n, 64, generator=g).to(dtype) for _ in range(2))
        buffers = [torch.randn(1, 4, max(slots) + 50, 64, generator=g).to(dtype) for _ in range(2)]
        results = []
        for chosen in (with_kernels(dtype), NO_KERNELS):
            w = attention.Writes.of(slots, dtype, "cpu", chosen)
            results.append(attention.attend(*[b.clone() for b in buffers], heads, None, q, k, v, w, chosen))
        assert (results[0].float() - results[1].float()).abs().max().item() < tol, (slots[0], n)


@needs_kernel
def test_engine_prefills_the_same_tokens_with_and_without_the_kernels(engine, loaded):
    """Whole prompts recomputed (mode "full"): the same greedy tokens with pc_rag's kernels as with sdpa."""
    uses_the_kernels(engine)
    prompt = "Attention is computed block by block. " * 40
    with_kernel = engine.generate(prompt, mode="full", max_new_tokens=16)
    without = sdpa_engine(loaded).generate(prompt, mode="full", max_new_tokens=16)
    assert list(with_kernel.token_ids) == list(without.token_ids)


@needs_kernel
def test_the_prefill_kernel_refuses_what_it_cannot_read():
    fn = kernels.loaded().prefill
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernels.prefill_attention(fn, torch.randn(2, 4, 16).half(), torch.randn(1, 4, 16).half(),
                                  torch.randn(1, 4, 16).half(), 0.25)
    q, k = torch.randn(2, 4, 24), torch.randn(1, 4, 24)  # head_dim not a multiple of 16
    with pytest.raises(RuntimeError, match="refused"):
        kernels.prefill_attention(fn, q, k, k, 0.25)
    with pytest.raises(RuntimeError, match="refused"):  # more query rows than keys
        kernels.prefill_attention(fn, torch.randn(2, 5, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 16), 0.25)
    assert not attention._prefill_kernel_takes(q[None], k[None], k[None], with_kernels())


@needs_kernel
def test_the_prefill_kernel_out_of_memory_is_an_error_not_a_crash():
    """Keys too long to pack (a broadcast row standing for 2^32 keys: 1 TiB to pack) raise MemoryError."""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":  # every allocation succeeds there; packing would then touch 1 TiB
            pytest.skip("this kernel never refuses memory (vm.overcommit_memory = 1)")
    fn = kernels.loaded().prefill
    keys = torch.randn(1, 1, 64).expand(1, 2**32, 64)
    with pytest.raises(MemoryError, match="packed keys"):
        kernels.prefill_attention(fn, torch.randn(1, 1, 64), keys, keys, 0.125)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("start,n", [(1, 300), (40, 160), (100, 300)])
def test_attention_after_a_short_prefix_equals_the_masked_reference(dtype, tol, start, n):
    """Fresh rows after a cached prefix where pc_rag's prefill kernel does not run (bf16 on AMX CPUs, CPUs without
    AVX-512, CUDA): a prefix of at most a quarter of them takes one causal call with its rows padded
    (`_attend_padded`), a longer one the masked or two-part path; every way against float64 attention."""
    g = torch.Generator().manual_seed(start + n)
    heads, group, dim = 2, 3, 32
    layer_k, layer_v = (torch.randn(1, heads, start + n + 20, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, heads * group, n, dim, generator=g).to(dtype)
    k, v = layer_k[:, :, start: start + n].clone(), layer_v[:, :, start: start + n].clone()
    w = attention.Writes.of(list(range(start, start + n)), dtype, "cpu", NO_KERNELS)
    assert (w.mask is None) == (start * attention.PADDED_PREFIX_SHARE <= n)
    got = attention.attend(layer_k, layer_v, Heads(group, dim ** -0.5), None, q, k, v, w, NO_KERNELS)
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
    fn = kernels.loaded().linear_rows
    if dtype == torch.bfloat16 and not kernels.loaded().linear_bf16:
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
