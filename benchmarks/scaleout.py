"""Several `pc-rag serve` workers on one machine behind SGLang's router: what the routing policy and a shared Redis
Cluster each contribute to reuse, time to first token and throughput.

    python -m benchmarks.scaleout --out bench_out [--workers 4] [--users 8] [--turns 3]

Set-up per configuration (policy x store), all fresh: `--workers` `pc-rag serve` processes (the offline bench Llama
unless `--model`; `OMP_NUM_THREADS=--threads` each), with a memory store, or a memory store over a 3-master Redis
Cluster this script starts (`pc_rag.testing.LocalRedisCluster`; its own key prefix per configuration), behind
`python -m sglang_router.launch_router --policy round_robin|cache_aware` (the `router` extra).

Trace: `--users` users at once, each a conversation of `--turns` turns sent one after another (the next turn
once the reply is in, with the reply in the history): half are chats (a shared system prompt, the user's own
questions), half RAG (the same system prompt, each turn two passages of a shared corpus marked as chunks with
`cache_control`, and a question). Requests stream (`stream_options.include_usage`), greedy, `--max-tokens` each,
with header `x-smg-routing-key: conversation-<user>` (what the router's `manual` policy is sticky by);
every worker answers one unrelated warm-up request first, untimed.
Reported per configuration: reuse share (cached / prompt tokens, all turns and turns 2+), TTFT p50 / p95 at the
client (through the router), requests/s over the whole trace, and how many requests each worker served.
Writes scaleout.json and scaleout.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

SYSTEM = ("You are the support assistant of the Python documentation team. Answer in one or two sentences, cite "
          "the passage you used, and say when the passages do not answer the question. ")
POLICIES = ("round_robin", "cache_aware", "cache_aware:balance-abs-threshold=2", "manual")


def corpus(tokenizer, n: int, tokens: int) -> list[str]:
    from .concurrency import corpus_chunks

    return corpus_chunks(tokenizer, n, tokens)


def conversation(user: int, turns: int, passages: list[str]) -> list[dict]:
    """The user messages of one conversation: a chat (even users) or RAG over `passages` (odd users)."""
    out = []
    for turn in range(turns):
        question = f"User {user}, question {turn}: how does item {user * 13 + turn} relate to the previous answer?"
        if user % 2 == 0:
            out.append({"role": "user", "content": question})
        else:
            a, b = passages[(user * 5 + turn * 3) % len(passages)], passages[(user * 7 + turn * 3 + 1) % len(passages)]
            out.append({"role": "user", "content": [
                {"type": "text", "text": a, "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "\n\n"},
                {"type": "text", "text": b, "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "\n\n" + question}]})
    return out


def run_trace(url: str, users: int, turns: int, passages: list[str], system: str, max_tokens: int,
              key: str) -> tuple[list[dict], float]:
    from openai import OpenAI

    results: list[dict] = []
    lock = threading.Lock()
    errors: list[str] = []

    def user(u: int) -> None:
        # The conversation's id as the routing key of the router's `manual` policy (other policies ignore it).
        client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=2, timeout=600,
                        default_headers={"x-smg-routing-key": f"conversation-{u}"})
        history = [{"role": "system", "content": system}]
        for turn, message in enumerate(conversation(u, turns, passages)):
            history.append(message)
            start = time.perf_counter()
            first, text, usage = None, [], None
            try:
                stream = client.chat.completions.create(model="m", messages=history, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True})
                for event in stream:
                    if event.choices and event.choices[0].delta.content:
                        first = first or time.perf_counter()
                        text.append(event.choices[0].delta.content)
                    if event.usage is not None:
                        usage = event.usage
            except Exception as e:  # counted: a lost answer
                with lock:
                    errors.append(f"user {u} turn {turn}: {type(e).__name__}: {e}")
                return
            end = time.perf_counter()
            history.append({"role": "assistant", "content": "".join(text)})
            with lock:
                results.append({"user": u, "turn": turn, "kind": "chat" if u % 2 == 0 else "rag",
                                "ttft_s": (first or end) - start, "total_s": end - start,
                                "prompt_tokens": usage.prompt_tokens if usage else 0,
                                "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else 0})

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        results.append({"errors": errors})
    return results, wall


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def summarize(results: list[dict], wall_s: float) -> dict:
    errors = [e for r in results if "errors" in r for e in r["errors"]]
    rows = [r for r in results if "errors" not in r]
    later = [r for r in rows if r["turn"] > 0]

    def share(rs):
        return sum(r["cached_tokens"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs))

    ttft = [r["ttft_s"] * 1000 for r in rows]
    return {"requests": len(rows), "lost": len(errors), "errors": errors[:5], "wall_s": wall_s,
            "reuse_all": share(rows), "reuse_later_turns": share(later),
            "reuse_chat_later": share([r for r in later if r["kind"] == "chat"]),
            "reuse_rag_later": share([r for r in later if r["kind"] == "rag"]),
            "ttft_p50_ms": statistics.median(ttft) if ttft else 0.0,
            "ttft_p95_ms": percentile(ttft, 95) if ttft else 0.0,
            "requests_per_s": len(rows) / wall_s}


def run_config(model, policy: str, cluster_spec: str | None, args, passages: list[str], tag: str) -> dict:
    from pc_rag.serve.process import RouterProcess, ServerProcess

    keys = Path(tempfile.mkdtemp(prefix="pc_rag_scaleout_")) / "keys.txt"
    keys.write_text("bench-key bench\n")
    keys.chmod(0o600)
    stores = ["--store", "memory"]
    if cluster_spec:
        stores += ["--store", f"{cluster_spec}?prefix=scaleout-{tag}:"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    workers = [ServerProcess(model, extra=[*stores, "--api-keys", keys, "--dtype", args.dtype],
                             env=dict(env, PC_RAG_CACHE_DIR=tempfile.mkdtemp(prefix="pc_rag_scaleout_cache_")))
               for _ in range(args.workers)]
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        for w in workers:  # untimed: each worker's first forward (kernels, allocator), with nothing the trace sends
            _warm_up(w.url, "bench-key")
        before = [w.health("bench-key")["served"] for w in workers]
        name, *options = policy.split(":")  # "cache_aware:balance-abs-threshold=2": router options after the name
        extra = [x for o in options for x in (f"--{o.split('=')[0]}", o.split("=", 1)[1])]
        with RouterProcess([w.url for w in workers], name, extra=extra, ready_key="bench-key",
                           python=args.router_python) as router:
            results, wall = run_trace(router.url, args.users, args.turns, passages, SYSTEM, args.max_tokens,
                                      "bench-key")
        served = [w.health("bench-key")["served"] - b for w, b in zip(workers, before, strict=True)]
    finally:
        for w in workers:
            w.stop()
    row = summarize(results, wall)
    row.update(policy=policy, shared_store="redis cluster" if cluster_spec else "none", served_per_worker=served)
    print(_line(row), flush=True)
    return row


def _warm_up(url: str, key: str) -> None:
    from openai import OpenAI

    OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "A warm-up request about nothing in the trace."}],
        max_tokens=4, temperature=0)


def _line(row: dict) -> str:
    return (f"{row['policy']:<12} store {row['shared_store']:<13} reuse {row['reuse_all']:.0%} (turns 2+: "
            f"{row['reuse_later_turns']:.0%})  TTFT p50 {row['ttft_p50_ms']:.0f} ms p95 {row['ttft_p95_ms']:.0f} ms  "
            f"{row['requests_per_s']:.2f} req/s  per worker {row['served_per_worker']}  lost {row['lost']}")


def markdown(result: dict) -> str:
    lines = [
        f"Model: {result['model']} ({result['dtype']}, CPU); {result['workers']} `pc-rag serve` workers on one machine "
        f"({result['machine']}, OMP_NUM_THREADS={result['threads']} each) behind sglang-router "
        f"{result['router_version']}; {result['users']} users at once ({result['users'] // 2} chats, "
        f"{result['users'] - result['users'] // 2} RAG over {result['passages']} shared passages of "
        f"{result['passage_tokens']} tokens), {result['turns']} turns each, {result['max_tokens']} tokens per "
        f"reply, greedy, streamed; {result['date']}.",
        "",
        "| policy | shared store | reuse, all turns | reuse, turns 2+ (chat / RAG) | TTFT p50 / p95 ms | requests/s "
        "| requests per worker | lost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['shared_store']} | {r['reuse_all']:.0%} | {r['reuse_later_turns']:.0%} "
            f"({r['reuse_chat_later']:.0%} / {r['reuse_rag_later']:.0%}) | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p95_ms']:.0f} | {r['requests_per_s']:.2f} | {' '.join(map(str, r['served_per_worker']))} "
            f"| {r['lost']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    import shutil

    import pc_rag
    from pc_rag.testing import LocalRedisCluster

    from .common import model_or_bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the offline 'bench' Llama under --out)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--passages", type=int, default=12)
    ap.add_argument("--passage-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES),
                    help="router policies, each optionally with router options: cache_aware:balance-abs-threshold=2")
    ap.add_argument("--router-python", help="a python with sglang_router (default: this one)")
    ap.add_argument("--no-cluster", action="store_true", help="only the configurations without a shared store")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = model_or_bench(args.model, out)
    tokenizer = pc_rag.Engine.from_pretrained(model, store="memory").tokenizer
    passages = corpus(tokenizer, args.passages, args.passage_tokens)
    cluster = None
    if not args.no_cluster and shutil.which("redis-server"):
        cluster = LocalRedisCluster(Path(tempfile.mkdtemp(prefix="pc_rag_scaleout_cluster_"))).start()
    rows = []
    try:
        for spec in ([None, cluster.spec] if cluster else [None]):
            for policy in args.policies:
                rows.append(run_config(model, policy, spec, args, passages, f"{policy.split(':')[0]}-{len(rows)}"))
    finally:
        if cluster:
            cluster.stop()
    from importlib.metadata import version

    result = {"model": Path(model).name, "dtype": args.dtype, "workers": args.workers, "users": args.users,
              "turns": args.turns, "max_tokens": args.max_tokens, "passages": args.passages,
              "passage_tokens": args.passage_tokens, "threads": args.threads,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "router_version": version("sglang-router") if args.router_python is None else "(other venv)",
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    (out / "scaleout.json").write_text(json.dumps(result, indent=2))
    (out / "scaleout.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
