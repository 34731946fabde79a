"""Concurrent streams: batched decoding against the one-at-a-time engine, in one process on the same prompts.

    python -m benchmarks.concurrency --streams 1 4 8 16 --out bench_out

Workload: N requests start together (one thread each, as LangChain's `abatch` or a server's workers do),
each a RAG prompt (a system text, two document chunks warm in the store, its own question), greedy, up to
`--max-new-tokens` tokens. For every N, two engines over the same loaded model, each with a fresh store
warmed with the same chunks and one question answered before the burst (so its system text is cached, as on
a server that has been running; each burst then asks new questions):
- serial:  `pc_rag.testing.one_at_a_time`, the engine before batching: each request runs its own decode loop and
           the requests take turns at every forward step;
- batched: the default, continuous batching (pc_rag/batch.py): one forward step for every request decoding.
Reported per row: aggregate decode tokens/s (the tokens after each request's first, divided by the time
during which at least one request was decoding: the union of the [first token, last token] intervals),
overall tokens/s (every token over the wall time of the run, prefills included), time to first token p50
and p95, and whether every greedy reply of the batched run equals the serial run's, token for token.
With `--http`, a third row per N drives a real `pc-rag serve` process with the `openai` client (streaming).
Writes concurrency.json and concurrency.md under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.store import MemoryStore

SYSTEM = "You are a helpful assistant. Answer the question using only the documents below.\n\n"


def corpus_chunks(tokenizer, n: int, tokens_per_chunk: int) -> list[str]:
    """`n` chunks of real text (pydoc topics) of about `tokens_per_chunk` tokens."""
    chunks = []
    for text in pc_rag.testing.pydoc_corpus():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for i in range(0, len(ids) - tokens_per_chunk, tokens_per_chunk):
            chunks.append(tokenizer.decode(ids[i: i + tokens_per_chunk]))
            if len(chunks) == n:
                return chunks
    return chunks


def prompts(chunks: list[str], n: int, burst: int = 0) -> list[list]:
    """Request i: the system text, two chunks (a pair that depends on i) and its own question (one that depends
    on `burst` too, so that a server's later bursts ask questions it has not seen)."""
    out = []
    for i in range(n):
        a, b = chunks[i % len(chunks)], chunks[(i * 3 + 1) % len(chunks)]
        item = i * 7 + 1000 * burst
        out.append([Text(SYSTEM), Chunk(a), Text("\n\n"), Chunk(b),
                    Text(f"\n\nQuestion {i}: which statement is described, and what is item {item} for?\nAnswer:")])
    return out


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def decode_window_s(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(results: list[dict], wall_s: float) -> dict:
    """results: per request, `start` (s since the run began), `ttft_s`, `total_s`, `tokens` (ids)."""
    decode_tokens = sum(len(r["tokens"]) - 1 for r in results)
    window = decode_window_s([(r["start"] + r["ttft_s"], r["start"] + r["total_s"]) for r in results
                              if len(r["tokens"]) > 1])
    ttft = [r["ttft_s"] for r in results]
    return {
        "requests": len(results),
        "tokens": sum(len(r["tokens"]) for r in results),
        "decode_tokens": decode_tokens,
        "decode_tok_s": decode_tokens / window if window > 0 else float("nan"),
        "overall_tok_s": sum(len(r["tokens"]) for r in results) / wall_s,
        "wall_s": wall_s,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p95_ms": 1000 * percentile(ttft, 95),
    }


def together(n: int, request) -> tuple[list[dict], float]:
    """`request(i)` for i < n, each in its own thread, released at once; returns its results (each a dict with
    "start" from the release, "ttft_s", "total_s", "tokens") and the wall time from the release to the last."""
    results: list[dict | None] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)
    released = [0.0]

    def one(i):
        barrier.wait()
        start = time.perf_counter()
        try:
            results[i] = request(i) | {"start": start - released[0]}
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    released[0] = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - released[0]
    if errors:
        raise errors[0]
    return results, wall


def run_engine(engine, batch: list, max_new_tokens: int) -> tuple[list[dict], float]:
    """Every prompt of `batch` in its own thread, released together; per-request timings and token ids."""

    def request(i):
        g = engine.generate(batch[i], mode="modular", max_new_tokens=max_new_tokens)
        return {"ttft_s": g.ttft_s, "total_s": g.total_s, "tokens": list(g.token_ids)}

    return together(len(batch), request)


def fresh_engine(model, tokenizer, chunks: list[str], batched: bool):
    engine = pc_rag.Engine(model, tokenizer, store=MemoryStore(max_bytes=8 << 30))
    if not batched:
        pc_rag.testing.one_at_a_time(engine)
    engine.warm(chunks, progress=False)
    # One question answered first: the system text's blocks are then stored, and a burst's prompts each have
    # their question left to compute (docs/speed.md#batching-and-concurrent-streams).
    engine.generate(prompts(chunks, 1, burst=-1)[0], mode="modular", max_new_tokens=4)
    return engine


def median_of(summaries: list[dict]) -> dict:
    """Each metric's median over the repetitions."""
    return {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}


def run(model_path, streams: list[int], max_new_tokens: int, chunk_tokens: int, reps: int = 3, dtype="float32",
        device="cpu", http: bool = False, same_prompts: bool = False) -> dict:
    base = pc_rag.Engine.from_pretrained(str(model_path), dtype=dtype, device=device, store="memory")
    model, tokenizer = base.model, base.tokenizer
    chunks = corpus_chunks(tokenizer, 16, chunk_tokens)
    requests = prompts(chunks, max(streams))
    prompt_tokens = len([t for s in base.segmenter.segments(requests[0]) for t in s.token_ids])
    # Warm-up (untimed): the first forwards of a process allocate and tune kernels.
    warm = fresh_engine(model, tokenizer, chunks, batched=True)
    run_engine(warm, requests[:2], 8)
    rows = []
    for n in streams:
        batch = requests[:n]
        runs: dict[str, list[dict]] = {"serial": [], "batched": []}
        replies: dict[str, list] = {"serial": [], "batched": []}
        for rep in range(reps):
            # Alternate which engine goes first: a shared machine's load drifts over a run.
            order = (("serial", False), ("batched", True)) if rep % 2 == 0 else (("batched", True), ("serial", False))
            for name, batched in order:
                engine = fresh_engine(model, tokenizer, chunks, batched)
                results, wall = run_engine(engine, batch, max_new_tokens)
                summary = summarize(results, wall)
                if batched:
                    summary["max_batch_seen"] = engine.stats()["decode"]["max_batch_seen"]
                runs[name].append(summary)
                replies[name].append([r["tokens"] for r in results])
        for name in ("serial", "batched"):
            row = {"streams": n, "engine": name, "reps": reps, **median_of(runs[name])}
            if name == "batched":
                same = [a == b for a in replies["serial"] for b in replies["batched"]]
                per_request = [all(s[i] == b[i] for s in replies["serial"] for b in replies["batched"])
                               for i in range(n)]
                row["identical_greedy"] = all(same)
                row["identical_requests"] = sum(per_request)
            rows.append(row)
            print(_line(row), flush=True)
        if http:
            row = {"streams": n, "engine": "server (HTTP)", **run_http(model_path, n, chunks, max_new_tokens,
                                                                        dtype, device, reps, same_prompts)}
            rows.append(row)
            print(_line(row), flush=True)
    return {
        "model": str(model_path),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d"),
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "reps": reps,
        "rows": rows,
    }


def run_http(model_path, n: int, chunks, max_new_tokens, dtype, device, reps: int, same_prompts: bool) -> dict:
    """The same kind of requests through a `pc-rag serve` process, streamed with the openai client (chat-less:
    /v1/completions with the prompt string, chunks marked by the `chunks` extension field): `reps` bursts on
    one server, medians (one burst of 8 streams lasts ~2 s here, and single bursts ranged 130-233 tokens/s).

    Each burst asks new questions over the same chunks, as users do; with `same_prompts` every burst sends the
    first one's prompts again, so that from the second burst on the server has each whole prompt cached (what
    the rows of stops 34-35 measured)."""
    from openai import OpenAI

    from pc_rag.serve.process import ServerProcess

    bursts = [["".join(p.text for p in request) for request in prompts(chunks, n, 0 if same_prompts else b)]
              for b in range(reps)]
    with ServerProcess(model_path, extra=["--dtype", dtype, "--device", device, "--store", "memory"]) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        # Untimed: the chunks' KV (as engine.warm does for the in-process rows: each chunk on its own, so no
        # request's prompt prefix is cached), and the kernels.
        for chunk in chunks:
            client.completions.create(model="m", prompt=chunk, max_tokens=1, extra_body={"chunks": [chunk]})
        client.completions.create(model="m", prompt="A warm-up request.", max_tokens=8)

        def request(texts, i):
            start = time.perf_counter()
            first = None
            n = 0
            stream = client.completions.create(model="m", prompt=texts[i], max_tokens=max_new_tokens, stream=True,
                                               extra_body={"chunks": chunks, "mode": "modular"},
                                               stream_options={"include_usage": True})
            for event in stream:
                if event.choices and event.choices[0].text and first is None:
                    first = time.perf_counter()
                if event.usage is not None:
                    n = event.usage.completion_tokens
            end = time.perf_counter()
            first = first or end
            return {"ttft_s": first - start, "total_s": end - start, "tokens": [0] * n}

        runs = [summarize(*together(n, lambda i, texts=texts: request(texts, i))) for texts in bursts]
    return {"reps": reps, "same_prompts": same_prompts, **median_of(runs)}


def _line(row) -> str:
    same = "" if "identical_greedy" not in row else f"  identical greedy: {row['identical_requests']}/{row['streams']}"
    return (f"{row['streams']:>3} streams  {row['engine']:<14} decode {row['decode_tok_s']:7.1f} tok/s  overall "
            f"{row['overall_tok_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.1f} ms  "
            f"p95 {row['ttft_p95_ms']:7.1f} ms{same}")


def markdown(result: dict) -> str:
    by = {(r["streams"], r["engine"]): r for r in result["rows"]}
    lines = [
        f"Model: {result['model']} ({result['parameters'] / 1e6:.1f}M parameters, {result['dtype']}, "
        f"{result['device']}); machine: {result['machine']}, {result['torch_threads']} torch threads; "
        f"{result['date']}. Each request: {result['prompt_tokens']} prompt tokens (two warm chunks, modular), up to "
        f"{result['max_new_tokens']} new tokens, greedy; all requests start together; medians of {result['reps']} "
        f"runs per cell, the two engines alternating.",
        "",
        "| streams | one-at-a-time decode tok/s | batched decode tok/s | speedup | one-at-a-time TTFT p50 / p95 ms "
        "| batched TTFT p50 / p95 ms | overall tok/s one-at-a-time / batched | greedy replies identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["streams"] for r in result["rows"]}):
        s, b = by[(n, "serial")], by[(n, "batched")]
        lines.append(
            f"| {n} | {s['decode_tok_s']:.1f} | {b['decode_tok_s']:.1f} | {b['decode_tok_s'] / s['decode_tok_s']:.2f}x "
            f"| {s['ttft_p50_ms']:.0f} / {s['ttft_p95_ms']:.0f} | {b['ttft_p50_ms']:.0f} / {b['ttft_p95_ms']:.0f} "
            f"| {s['overall_tok_s']:.1f} / {b['overall_tok_s']:.1f} | {b['identical_requests']}/{n} |")
    http = [r for r in result["rows"] if r["engine"] == "server (HTTP)"]
    if http:
        asks = "the same prompts every burst" if http[0].get("same_prompts") else "new questions every burst"
        lines += ["", f"Through `pc-rag serve` (openai client, streaming, {asks}; medians of {result['reps']} "
                  "bursts on one server per row):", "",
                  "| streams | decode tok/s | x one stream | TTFT p50 / p95 ms | overall tok/s |",
                  "|---|---|---|---|---|"]
        one = http[0]["decode_tok_s"]  # the smallest stream count asked for
        for r in http:
            lines.append(f"| {r['streams']} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / one:.2f}x "
                         f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | {r['overall_tok_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    from .common import model_or_bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the offline 'bench' Llama under --out)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="runs per engine and stream count (medians reported)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens per document chunk (two per prompt)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--http", action="store_true", help="also drive a `pc-rag serve` process (needs openai)")
    ap.add_argument("--same-prompts", action="store_true",
                    help="every HTTP burst sends the first burst's prompts again (default: new questions each burst)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = model_or_bench(args.model, out)
    result = run(model, args.streams, args.max_new_tokens, args.chunk_tokens, args.reps, args.dtype, args.device,
                 args.http, args.same_prompts)
    (out / "concurrency.json").write_text(json.dumps(result, indent=2))
    (out / "concurrency.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
