"""The benchmark scripts' own claims, checked small: exact == full on the trained model, blend's end points,
that training is reproducible bit for bit (the committed checkpoint relies on it), and the GPU check's checks
on the CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pc_rag
from benchmarks import accuracy, train_retrieval
from benchmarks.retrieval_task import make_example, names, values

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "benchmarks" / "retrieval-model"


@pytest.fixture(scope="module")
def engine():
    return pc_rag.Engine.from_pretrained(MODEL, store="memory")


def test_accuracy_answers_exact_equals_full_and_blend_end_points(engine):
    rng = random.Random(3)
    name_list, value_list = names(), values()
    blends = ["1.0:chunk_start", "1.0:deviation", "0.0:deviation"]
    for task in ("single", "two_hop"):
        for _ in range(4):
            ex = make_example(rng, task, 4, name_list, value_list)
            got = accuracy.answers(engine, ex, blends)
            assert got["exact"] == got["full"], ex
            # recomputing every reused token is a full prefill; recomputing none is modular
            assert got["blend 1 chunk_start"] == got["full"] == got["blend 1 deviation"], ex
            assert got["blend 0 deviation"] == got["modular"], ex


def test_accuracy_rejects_a_bad_blend_setting():
    with pytest.raises(SystemExit, match="0.3:sideways"):
        accuracy.parse_blend("0.3:sideways")


def test_training_is_reproducible(tmp_path):
    args = ["--layers", "1", "--hidden", "32", "--intermediate", "64", "--batch", "8", "--max-steps", "3",
            "--eval-every", "3", "--eval-n", "4", "--max-chunks", "3"]
    for run in ("a", "b"):
        train_retrieval.main([*args, "--out", str(tmp_path / run)])
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # a longer run stopped at the same step (no decay: the same schedule) is the same run
    train_retrieval.main([*args, "--out", str(tmp_path / "d"), "--max-steps", "6", "--until-step", "3"])
    d = load_file(tmp_path / "d" / "model.safetensors")
    assert all(a[k].equal(d[k]) for k in a)
    # and the continuation stage starts from the given weights
    train_retrieval.main([*args, "--out", str(tmp_path / "c"), "--init", str(tmp_path / "a"), "--start-level", "3",
                          "--two-hop-share", "0.75", "--decay"])
    c = load_file(tmp_path / "c" / "model.safetensors")
    assert a.keys() == c.keys() and not all(a[k].equal(c[k]) for k in a)


def test_ttft_benchmark_runs_and_stores_the_formula_bytes(tiny_path, tmp_path):
    from benchmarks import ttft

    result = ttft.run(tiny_path, lengths=[600], reps=1, decode_tokens=8)
    assert len(result["rows"]) == 1
    row = result["rows"][0]
    assert result["bytes_per_token_stored"] == result["bytes_per_token_formula"]
    redis_columns = {"pc_modular_warm_redis", "pc_exact_warm_redis"}  # only with a redis-server binary
    for key, _ in ttft.COLUMNS:
        if key in row or key not in redis_columns:
            assert row[key]["median_s"] > 0, key
    steps = row["load_steps"]["modular_disk"]
    assert steps["bytes_read"] > 0 and steps["read_ms"] > 0 and steps["copy_ms"] > 0
    assert row["hf_generate_long"]["tokens_per_s"] > 0
    md = ttft.markdown(result)
    assert "| decode tok/s full |" in md and "| modular disk |" in md
    ttft.plot(result, tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").stat().st_size > 0


def test_loads_benchmark_runs_prefetch_and_compression(tiny_path):
    pytest.importorskip("langchain_pc_rag")
    from benchmarks import loads

    result = loads.run(tiny_path, lengths=[600], reps=1, fidelity_prompts=2)
    row = result["rows"][0]
    assert set(row["prefetch"]) >= {"memory", "disk", "disk_prefetch", "disk_prefetch_rerank"}
    assert row["prefetch"]["disk_prefetch"]["ttft_ms"] > 0
    # int8 blocks: a quarter of float32's bytes, plus scales and header
    assert 0.24 < row["bytes_per_token"]["disk int8"] / row["bytes_per_token"]["disk"] < 0.3
    assert result["fidelity"]["none"]["kl_modular"] == 0.0  # the reference against itself
    assert "| int8 |" in loads.markdown(result)


def test_gpu_check_runs_its_checks_on_the_cpu(capsys):
    # The CUDA check's own code paths, on the tiny models (the CUDA run itself needs a GPU: docs/models.md).
    from benchmarks import gpu_check

    assert gpu_check.main(["--device", "cpu", "--small"]) == 0
    out = capsys.readouterr().out
    assert out.count("| pass |") == 12 and "FAIL" not in out and out.count("| measured |") == 2
    if not torch.cuda.is_available():  # without a GPU it says so and runs nothing
        assert gpu_check.main([]) == 0 and "no CUDA device" in capsys.readouterr().out
