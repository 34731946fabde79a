"""A long run of `pc-rag serve`: does the server's resident memory stay flat over many mixed requests?

    python -m benchmarks.soak --requests 100000 --clients 4 --out bench_out

A `pc-rag serve` child process (the offline tiny Llama unless --model, a bounded memory store, three tenants with
keys of their own) answers --requests requests from --clients threads, each request drawn by a seeded generator
from a mix of what clients send (`KINDS`): plain completions, chat with documents marked by `cache_control` or
`chunks`, streamed replies read to the end and streams cut after a few events, forced tool calls and tools the
model may call, n > 1, logprobs, JSON schemas (`response_format`), several `cache_salt`s. The texts recur as a
service's do: a pool of documents (pydoc topics), a few system texts, questions drawn from a pool, so the
server's caches (the store, the reply, passage and prefix indexes, the tokenizer's memo) fill to what this
traffic needs during the warm-up and a request that leaks shows as growth after it.

Sampled every --sample-every requests: the server's resident memory (VmRSS), requests per second, the statuses
so far and the store's bytes (/metrics). Reported: the curve, and the growth from the end of the warm-up
(--warmup requests) to the end, which docs/serve.md quotes. Writes soak.json (the curve as it is sampled, so an
interrupted run keeps what it measured) and soak.md under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

TENANTS = ("alpha", "beta", "gamma")
SYSTEMS = ("Answer from the documents.", "You are a careful assistant. Use only the context below.",
           "Reply in one short sentence, citing the document you used.")
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a term up in the reference manual.",
    "parameters": {"type": "object", "properties": {"term": {"type": "string", "maxLength": 12}},
                   "required": ["term"]}}}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "confidence"]}
# What each request is, and how often (weights): the mix of a service with chat, RAG and agent clients.
KINDS = {"plain": 4, "chunks": 2, "marked_chat": 3, "stream": 3, "cut_stream": 2, "tools_forced": 1,
         "tools_auto": 1, "n2": 1, "logprobs": 1, "json_schema": 1, "completion_logprobs": 1}


def documents(n: int, chars: int = 400) -> list[str]:
    """`n` document texts of about `chars` characters: slices of pydoc topics."""
    from pc_rag.testing import pydoc_corpus

    out = []
    for text in pydoc_corpus():
        for i in range(0, len(text) - chars, chars):
            out.append(" ".join(text[i: i + chars].split()))
            if len(out) == n:
                return out
    return out


class Mix:
    """Request bodies drawn from a seeded generator: `body(i)` is the path, the body, the tenant and how many
    events to read of a stream (None: all)."""

    def __init__(self, seed: int, docs: list[str], questions: int, max_tokens: int):
        self.rng = random.Random(seed)
        self.docs = docs
        self.questions = [f"Question {q}: what does the manual say about item {q * 7 % 101}?" for q in range(questions)]
        self.max_tokens = max_tokens
        self.kinds, self.weights = list(KINDS), list(KINDS.values())
        self.lock = threading.Lock()

    def body(self) -> tuple[str, str, dict, str, int | None]:
        with self.lock:  # one generator, drawn by every client thread
            r = self.rng
            kind = r.choices(self.kinds, self.weights)[0]
            tenant = r.choice(TENANTS)
            system, question = r.choice(SYSTEMS), r.choice(self.questions)
            picked = r.sample(self.docs, r.choice([1, 2, 3]))
            salt = r.choice([None, None, "s1", "s2"])
            cut = r.choice([0, 1, 3])
        common = {"model": "m", "max_tokens": self.max_tokens, "temperature": 0.7, "seed": 1}
        if salt is not None:
            common["cache_salt"] = salt
        context = "\n\n".join(picked)
        if kind in ("plain", "completion_logprobs"):
            body = {**common, "prompt": f"{system}\n\n{context}\n\n{question}\nAnswer:"}
            if kind == "completion_logprobs":
                body["logprobs"] = 2
            return kind, "/v1/completions", body, tenant, None
        if kind == "chunks":
            return kind, "/v1/completions", {**common, "prompt": f"{system}\n\n{context}\n\n{question}\nAnswer:",
                                             "chunks": picked}, tenant, None
        parts = [{"type": "text", "text": d + "\n\n", "cache_control": {"type": "ephemeral"}} for d in picked]
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
        body = {**common, "messages": messages}
        if kind in ("stream", "cut_stream"):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        elif kind == "tools_forced":
            body |= {"tools": TOOLS, "tool_choice": "required"}
        elif kind == "tools_auto":
            body |= {"tools": TOOLS, "tool_choice": "auto"}
        elif kind == "n2":
            body["n"] = 2
        elif kind == "logprobs":
            body |= {"logprobs": True, "top_logprobs": 2}
        elif kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
        return kind, "/v1/chat/completions", body, tenant, cut if kind == "cut_stream" else None


def send(http: httpx.Client, path: str, body: dict, key: str, cut: int | None) -> int:
    """One request; a stream is read to its end, or to its `cut`-th event and then closed (the server sees the
    client go away mid-stream)."""
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        return http.post(path, json=body, headers=headers).status_code
    with http.stream("POST", path, json=body, headers=headers) as r:
        for n, _line in enumerate(r.iter_lines()):
            if cut is not None and n >= cut:
                break
        return r.status_code


def caches(http: httpx.Client, key: str) -> tuple[dict, dict]:
    """What the server's bounded indexes and store hold, and what its heap releases cost (/health with a key:
    `caches`, `heap_releases`)."""
    health = http.get("/health", headers={"Authorization": f"Bearer {key}"}).json()
    return health["caches"], health.get("heap_releases", {})


def drive(url: str, keys: dict[str, str], mix: Mix, requests: int, clients: int, sample_every: int,
          rss, on_sample) -> Counter:
    """`requests` requests from `clients` threads; every `sample_every` finished requests, `on_sample(row)` with the
    count, `rss()` (the server's resident bytes), the rate since the last sample, the statuses so far and what the
    server's caches hold."""
    statuses: Counter = Counter()
    kinds: Counter = Counter()
    lock = threading.Lock()
    issued = [0]
    done = [0]
    last = [time.perf_counter(), 0]
    errors: list[BaseException] = []

    def worker():
        with httpx.Client(base_url=url, timeout=120) as http:
            while True:
                with lock:
                    if issued[0] >= requests or errors:
                        return
                    issued[0] += 1
                kind, path, body, tenant, cut = mix.body()
                try:
                    status = send(http, path, body, keys[tenant], cut)
                except httpx.HTTPError as e:  # the server went away or stopped answering: the run ends
                    errors.append(e)
                    return
                with lock:
                    statuses[status] += 1
                    kinds[kind] += 1
                    done[0] += 1
                    n = done[0]
                    sample = n % sample_every == 0
                    if sample:
                        now = time.perf_counter()
                        rate = (n - last[1]) / (now - last[0])
                        last[:] = [now, n]
                if sample:
                    held, released = caches(http, keys[TENANTS[0]])
                    on_sample({"requests": n, "rss_mib": rss() / 2**20, "req_per_s": rate,
                               "store_mib": held.pop("store_bytes") / 2**20, "caches": held,
                               "heap_releases": released,
                               "statuses": dict(sorted(statuses.items()))})

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return kinds


def growth(curve: list[dict], warmup: int) -> dict:
    """Resident memory from the first sample at or after `warmup` requests to the last, and its largest excursion
    above the first."""
    after = [row for row in curve if row["requests"] >= warmup]
    if len(after) < 2:
        return {}
    first = after[0]["rss_mib"]
    return {"from_requests": after[0]["requests"], "to_requests": after[-1]["requests"], "rss_start_mib": first,
            "rss_end_mib": after[-1]["rss_mib"], "growth_mib": after[-1]["rss_mib"] - first,
            "max_above_start_mib": max(row["rss_mib"] for row in after) - first}


def markdown(report: dict) -> str:
    g = report["growth"]
    lines = [f"# Soak: {report['requests_done']:,} requests, {report['clients']} clients", "",
             f"{report['machine']}; model {report['model']}; store {report['store']}; max_tokens "
             f"{report['max_tokens']}.", ""]
    if g:
        lines += [f"Resident memory from request {g['from_requests']:,} to {g['to_requests']:,}: "
                  f"{g['rss_start_mib']:.1f} -> {g['rss_end_mib']:.1f} MiB ({g['growth_mib']:+.1f} MiB; at most "
                  f"{g['max_above_start_mib']:+.1f} MiB above the start).", ""]
    released = report["curve"][-1].get("heap_releases") if report["curve"] else None
    if released:
        lines += [f"The server gave its free heap back {released['count']:,} times (every 30 s), the longest in "
                  f"{released['max_ms']:.1f} ms.", ""]
    lines += ["| requests | RSS MiB | store MiB | prefix blocks | replies | passages | req/s |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['requests']:,} | {r['rss_mib']:.1f} | {r['store_mib']:.1f} | {r['caches']['prefix_blocks']:,} | "
              f"{r['caches']['replies']:,} | {r['caches']['passages']:,} | {r['req_per_s']:.1f} |"
              for r in report["curve"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    from pc_rag.serve.process import ServerProcess
    from pc_rag.testing import build_tiny_llama

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the offline tiny Llama, built under --out)")
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    ap.add_argument("--sample-every", type=int, default=1000, metavar="N")
    ap.add_argument("--warmup", type=int, default=5000, metavar="N",
                    help="requests before the growth is measured (the caches fill to what the traffic needs)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--documents", type=int, default=48, help="documents in the pool")
    ap.add_argument("--questions", type=int, default=64, help="questions in the pool")
    ap.add_argument("--store", default="memory:256MiB", help="the server's store spec")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_tiny_llama(args.out / "soak-model", size="tiny", seed=0)

    keys = {tenant: f"soak-key-{tenant}" for tenant in TENANTS}
    key_file = Path(tempfile.mkstemp(prefix="soak_keys_", suffix=".txt")[1])
    key_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in keys.items()))
    report = {"model": str(model), "machine": f"{platform.processor() or platform.machine()}, "
              f"{__import__('os').cpu_count()} CPUs", "store": args.store, "clients": args.clients,
              "max_tokens": args.max_tokens, "requests_asked": args.requests, "requests_done": 0,
              "warmup": args.warmup, "curve": [], "growth": {}}
    started = time.perf_counter()

    def on_sample(row: dict) -> None:
        row["elapsed_s"] = time.perf_counter() - started
        report["curve"].append(row)
        report["requests_done"] = row["requests"]
        report["growth"] = growth(report["curve"], args.warmup)
        (args.out / "soak.json").write_text(json.dumps(report, indent=1))
        print(f"{row['requests']:>7,} requests  RSS {row['rss_mib']:7.1f} MiB  store {row['store_mib']:6.1f} MiB  "
              f"{row['req_per_s']:5.1f} req/s  {row['statuses']}  {row['caches']}", flush=True)

    try:
        with ServerProcess(model, extra=["--store", args.store, "--api-keys", str(key_file),
                                         "--default-max-tokens", str(args.max_tokens)]) as server:
            mix = Mix(args.seed, documents(args.documents), args.questions, args.max_tokens)
            report["kinds"] = dict(drive(server.url, keys, mix, args.requests, args.clients, args.sample_every,
                                         server.rss_bytes, on_sample))
    finally:
        key_file.unlink(missing_ok=True)
    report["wall_s"] = time.perf_counter() - started
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    (args.out / "soak.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
