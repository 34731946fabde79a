"""The `pc-rag` command: the demo across a restart, warm/stats/clear, and one-line errors.

References: the demo's own JSON report (cached tokens and per-tier store hits) in a first and a second process
on one cache folder; `stats` against the files `warm` wrote; the exit status and stderr of a bad path.
"""

import json
import shutil
import subprocess
import sys

import pytest

from pc_rag import cli
from pc_rag.prefix import BLOCK_TOKENS

from .conftest import DEMO_CHUNKS, worktree_env


def _run(args, cache_dir, timeout=120):
    return subprocess.run([sys.executable, "-m", "pc_rag", *args], capture_output=True, text=True,
                          env=worktree_env(cache_dir), timeout=timeout)


def test_demo_second_process_reads_kv_from_disk(tiny_path, seeded_embeddings, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(seeded_embeddings, cache / "embeddings")
    args = ["demo", "--model", str(tiny_path), "--questions", "2", "-k", "3", "--max-chunks", str(DEMO_CHUNKS),
            "--max-new-tokens", "4", "--json"]
    reports = []
    for _ in range(2):
        done = _run(args, cache)
        assert done.returncode == 0, done.stderr
        reports.append(json.loads(done.stdout))
    first, second = reports
    assert first["random_weights"] and len(first["rows"]) == 2 * 3  # 2 questions x (full, exact, modular)
    assert first["store"]["tiers"]["disk"]["hits"] == 0  # an empty folder: nothing to find yet
    assert second["store"]["tiers"]["disk"]["hits"] > 0
    q1 = {r["mode"]: r for r in second["rows"] if r["question"] == 1}
    assert q1["full"]["cached_tokens"] == 0
    # The restarted process's first cached request (modular runs before exact) reads its system text and chunks
    # from disk (a separator seen twice in one prompt is read once, then found in memory where it was promoted).
    served = q1["modular"]["served"]
    disk, memory = served.get("disk", 0), served.get("memory", 0)
    assert disk > 0 and disk + memory == q1["modular"]["cached_tokens"]
    # exact finds the first process's prefix blocks on disk: whole blocks only (the short tail of a request stays
    # in the memory of the process that computed it), so at most BLOCK_TOKENS - 1 tokens short of the prompt.
    assert q1["exact"]["cached_tokens"] >= q1["exact"]["prompt_tokens"] - BLOCK_TOKENS


def test_warm_then_stats_then_clear(tiny_path, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    from pydoc_data.topics import topics

    (docs / "a.txt").write_text(topics["for"])
    (docs / "b.md").write_text(topics["while"])
    (docs / "skip.bin").write_bytes(b"\0\1")  # not .txt/.md: ignored
    cache = ["--cache-dir", str(tmp_path / "cache")]
    from pc_rag.demo.retrieval import read_documents

    expected = len(read_documents([docs]))

    assert cli.main(["warm", str(docs), "--model", str(tiny_path), *cache]) == 0
    assert f"{expected} chunks: {expected} encoded" in capsys.readouterr().out
    assert cli.main(["warm", str(docs / "a.txt"), "--model", str(tiny_path), *cache]) == 0
    assert "0 encoded" in capsys.readouterr().out  # already in the store

    assert cli.main(["stats", "--json", *cache]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["kv_entries"] == expected and stats["kv_bytes"] > 0

    assert cli.main(["clear", *cache]) == 0
    capsys.readouterr()
    assert cli.main(["stats", "--json", *cache]) == 0
    assert json.loads(capsys.readouterr().out)["kv_entries"] == 0


def test_explain_after_warm_shows_disk_hits_without_running_the_model(tiny_path, tmp_path, capsys, monkeypatch):
    """Reference: the chunks `warm` stored (each reported as a disk hit where the prompt holds it) and the store's
    files and their times before the call (unchanged); the model's forward raises if called."""
    from pydoc_data.topics import topics

    from pc_rag.demo.retrieval import read_documents
    from pc_rag.model import LlamaRunner
    from pc_rag.store import block_files

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(topics["for"][:1200])
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert cli.main(["warm", str(docs), "--model", str(tiny_path), *cache]) == 0
    chunks = read_documents([docs])
    capsys.readouterr()
    files = [(p, p.stat().st_mtime_ns) for p, _ in block_files(tmp_path / "cache")]

    def refuse(*args, **kwargs):
        raise AssertionError("explain ran the model")

    monkeypatch.setattr(LlamaRunner, "forward", refuse)
    prompt = "Context:\n" + "\n\n".join(chunks) + "\n\nQuestion: what does the loop do?"
    args = ["explain", prompt, "--docs", str(docs), "--model", str(tiny_path), *cache]
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    hits = [r for r in report["rows"] if r["source"] == "chunk" and r["kind"] == "chunk"]
    assert len(hits) == len(chunks) and {r["kv"] for r in hits} == {"disk hit, read into the buffer"}
    assert report["reused_tokens"] >= sum(r["tokens"] for r in hits) and report["encoded_tokens"] <= 2  # separators
    assert [(p, p.stat().st_mtime_ns) for p, _ in block_files(tmp_path / "cache")] == files
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["kind", "tokens"] and lines[-1].startswith("modular: ")
    assert cli.main(["explain", "  ", *cache]) == cli.EXIT_USAGE
    assert "the prompt is empty" in capsys.readouterr().err


def test_bench_runs_the_ttft_benchmark_as_a_module(capsys, monkeypatch, tmp_path):
    """Reference: benchmarks/ttft.py's own argument parser answering -h (it imports benchmarks.common, so it only
    runs as a module of the benchmarks package), from any working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "-h"])
    assert done.value.code == 0 and "--lengths" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["warm", "/no/such/folder"], ["demo", "--model", "/no/such/model"]])
def test_bad_path_is_one_line_and_exit_2(args, tmp_path, capsys):
    assert cli.main([*args, "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/no/such/" in err and "Traceback" not in err


def test_bad_path_in_a_real_process(tmp_path):
    done = _run(["warm", str(tmp_path / "missing")], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"pc-rag warm: error: {tmp_path / 'missing'}: no such file or folder"]


@pytest.mark.parametrize("device, words", [
    ("cuda", "device 'cuda': "),
    ("mps", "device 'mps': MPS"),
    ("garbage", "device 'garbage' is not a device"),
])
@pytest.mark.parametrize("command", [["demo"], ["warm", "{docs}"]])
def test_bad_device_is_one_line_before_any_weights_load(command, device, words, tmp_path, capsys, monkeypatch):
    import torch

    import pc_rag
    from pc_rag import demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same outcome on a GPU machine
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights loaded before the device was checked")

    monkeypatch.setattr(demo, "demo_model", must_not_load)
    monkeypatch.setattr(pc_rag.Engine, "from_pretrained", must_not_load)
    (tmp_path / "a.txt").write_text("A document.")
    args = [a.format(docs=tmp_path / "a.txt") for a in command]
    assert cli.main([*args, "--device", device, "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_engine_from_pretrained_checks_the_device_first(tiny_path, monkeypatch):
    import torch

    import pc_rag
    from pc_rag.model import LlamaRunner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(LlamaRunner, "from_pretrained", classmethod(lambda cls, *a, **k: pytest.fail("loaded")))
    with pytest.raises(pc_rag.OptionError, match="device 'cuda:0'"):
        pc_rag.Engine.from_pretrained(tiny_path, device="cuda:0")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a torch without a usable CUDA GPU")
def test_cuda_on_a_cpu_build_in_a_real_process(tiny_path, tmp_path):
    # Was an AssertionError traceback from torch ("Torch not compiled with CUDA enabled") after loading.
    done = _run(["demo", "--model", str(tiny_path), "--device", "cuda"], tmp_path)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("pc-rag demo: error: device 'cuda': ")
