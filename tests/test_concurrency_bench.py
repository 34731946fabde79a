"""benchmarks/concurrency.py on the tiny model, small: the report it writes, and that the batched engine's greedy
replies equal the one-at-a-time engine's (the script's own check, on every request of every run)."""

import json


def test_concurrency_benchmark_reports_both_engines_and_identical_replies(tiny_path, tmp_path):
    from benchmarks import concurrency

    report = concurrency.main(["--model", str(tiny_path), "--streams", "1", "3", "--max-new-tokens", "32",
                               "--reps", "1", "--chunk-tokens", "64", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "concurrency.json").read_text()) == report
    rows = {(r["streams"], r["engine"]): r for r in report["rows"]}
    assert set(rows) == {(1, "serial"), (1, "batched"), (3, "serial"), (3, "batched")}
    for r in rows.values():
        assert r["decode_tokens"] > 0 and r["decode_tok_s"] > 0 and r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0
    assert rows[(3, "batched")]["identical_greedy"] and rows[(3, "batched")]["identical_requests"] == 3
    # 32 tokens each: long enough that a request still decodes when the next one's prefill ends (with 6, a fast
    # CPU finished each before the next joined: max_batch_seen 0, once in a full run on an AVX-512 CPU)
    assert rows[(3, "batched")]["max_batch_seen"] >= 2
    assert "| 3 |" in (tmp_path / "concurrency.md").read_text()
