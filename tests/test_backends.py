"""What runs each operation of a runner (pc_rag/model/backends.py): chosen once per runner, with why, logged in one
line and reported by engine.stats().

References: the rules of `backends.choose` and `unfit` (CPU only, fp32/bf16, head sizes the kernels take, eager
attention for soft-capped logits, sdpa for bf16 on AMX CPUs where the kernel has no AMX path), checked on a library
whose capabilities the test sets; a runner's own choice against what it then runs is tests/test_kernels.py's."""

from __future__ import annotations

import dataclasses
import logging

import torch

import pc_rag
from pc_rag.model import LlamaRunner, backends, kernels
from pc_rag.store import MemoryStore
from pc_rag.testing import build_tiny


def library(linear_bf16=True, prefill_amx=False) -> kernels.Kernels:
    """A stand-in for the compiled library with the capabilities given (choose reads only those)."""
    functions = {f.name: object() for f in dataclasses.fields(kernels.Kernels) if f.type != "bool"}
    return kernels.Kernels(**functions, linear_bf16=linear_bf16, prefill_amx=prefill_amx)


def test_choose_takes_the_kernels_where_they_fit():
    lib = library()
    fp32 = backends.choose(torch.float32, False, lib)
    assert (fp32.decode_kernel, fp32.prefill_kernel, fp32.relocate_kernel) == (lib.decode, lib.prefill, None)
    assert fp32.relocation.backend == "torch" and "as fast as the kernel" in fp32.relocation.why
    bf16 = backends.choose(torch.bfloat16, False, lib)
    assert bf16.relocate_kernel is lib.relocate_keys and bf16.decode_attention.backend == "kernel"
    # what the runner chooses later stays marked as not chosen here
    assert fp32.products == fp32.few_rows == fp32.layers == backends.NOT_CHOSEN


def test_choose_says_why_not(monkeypatch):
    off = backends.choose(torch.float32, False, None, "PC_RAG_NO_KERNELS is set")
    assert [getattr(off, op).backend for op in ("decode_attention", "prefill_attention", "relocation")] == [
        "sdpa", "sdpa", "torch"]
    assert {getattr(off, op).why for op in ("decode_attention", "prefill_attention", "relocation")} == {
        "PC_RAG_NO_KERNELS is set"}
    assert off.decode_kernel is None and off.prefill_kernel is None and off.relocate_kernel is None
    capped = backends.choose(torch.float32, True, library())  # Gemma 2
    assert capped.decode_attention.backend == capped.prefill_attention.backend == "eager"
    assert capped.decode_kernel is None and capped.prefill_kernel is None
    # bf16 on an AMX CPU: the kernel only where it has AMX tiles of its own, else sdpa (which uses them)
    monkeypatch.setattr(kernels, "has_amx", lambda: True)
    assert backends.choose(torch.bfloat16, False, library(prefill_amx=False)).prefill_attention.backend == "sdpa"
    assert backends.choose(torch.bfloat16, False, library(prefill_amx=True)).prefill_attention.backend == "kernel"
    assert backends.unfit(torch.float16, "cpu", 64) == "the native kernels read fp32 or bf16; this model is float16"
    assert "CPU-only" in backends.unfit(torch.float32, "meta", 64)
    assert "head_dim" in backends.unfit(torch.float32, "cpu", 24)
    assert backends.unfit(torch.bfloat16, "cpu", 256) is None


def test_a_runner_logs_its_choice_in_one_line_and_the_engine_reports_it(loaded, caplog):
    model, tok = loaded
    with caplog.at_level(logging.INFO, logger="pc_rag"):
        runner = LlamaRunner(model, tok)
    [line] = [r.getMessage() for r in caplog.records if " runs decode attention " in r.getMessage()]
    assert line.endswith(runner.backends.summary())
    for op in backends.OPERATIONS:
        assert f"{op.replace('_', ' ')} {getattr(runner.backends, op).backend}" in line
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    reported = engine.stats()["backends"]
    assert reported == engine.runner.backends.as_dict() and list(reported) == list(backends.OPERATIONS)
    assert all(set(c) == {"backend", "why"} and c["why"] for c in reported.values())
    assert reported["products"]["backend"] == "oneDNN" and engine.runner.weights.packed


def test_a_runner_built_without_native_kernels_says_so(loaded):
    runner = LlamaRunner(*loaded, native=False)
    chosen = runner.backends
    assert chosen.kernels is None and runner._fused is None and runner.solo_chunk_tokens == 0
    assert (chosen.decode_attention.backend, chosen.prefill_attention.backend, chosen.relocation.backend,
            chosen.few_rows.backend, chosen.layers.backend) == ("sdpa", "sdpa", "torch", "oneDNN", "modules")
    assert "native=False" in chosen.decode_attention.why and "native=False" in chosen.few_rows.why
    assert all(p.few is None and p.kernel is None for lw in runner.weights.layers for p in (lw.qkv, lw.down))


def test_soft_capped_and_half_precision_models_report_their_paths(tmp_path):
    gemma = pc_rag.Engine.from_pretrained(build_tiny(tmp_path / "g", "gemma2"), store="memory")
    assert gemma.stats()["backends"]["decode_attention"]["backend"] == "eager"
    assert gemma.stats()["backends"]["layers"]["backend"] == "modules"  # not the standard layer
    half = pc_rag.Engine.from_pretrained(build_tiny(tmp_path / "h", "llama"), store="memory", dtype="float16")
    reported = half.stats()["backends"]
    assert reported["decode_attention"]["backend"] == "sdpa" and "float16" in reported["decode_attention"]["why"]
    assert reported["products"]["backend"] == "modules"
