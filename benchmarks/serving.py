"""A RAG service's trace, and what the memory tier's replacement policy keeps of it.

    python -m benchmarks.serving [--out DIR] [--chunks 1200] [--requests 4000] [--budget 0.2]

The trace (`rag_trace`): a corpus of chunks cut from Python's documentation (~250 tokens each), document
popularity drawn from a Zipf law (alpha 0.8 and 1.1), 4-8 retrieved chunks per question, each question's chunks
in a shuffled order, Poisson arrivals (`arrivals`), and some multi-turn conversations (a question sent again with
one more turn).

Eviction (`eviction`): the memory tier as the engine uses it (a lookup per chunk; a miss is encoded or read from
disk, then put) at a byte budget of `--budget` of the corpus' KV, for each policy of `pc_rag.store.memory`
(POLICIES): the share of the requests' chunk tokens found in memory. Block sizes follow each chunk's tokens (the
tensors are small stand-ins: a policy sees only sizes, keys and the order of uses), beside two bounds no policy
can pass (`bounds`). Prints a table, writes serving.json: `eviction.<policy>.<alpha>.hit_ratio`.

Load (`--systems`, default every one found): the trace sent to each server in turn, one at a time on this
machine, with the `openai` async client as an app sends it: a system message, then one user message holding the
retrieved documents as plain text (joined by blank lines) and the question; a follow-up sends the conversation
so far (the earlier answer included) and one more question. Answers of 32-64 tokens (`--answer-tokens`; seeded
per request), streamed, greedy. Rates double from `--rates`' first value while the TTFT p99 stays under `--slo`, and one
rate past it is measured too (2x the saturation rate); where the first rate fails they halve until one holds.
Each rate sends `--requests-per-rate` requests (fewer below 1 req/s: arrivals span at most
`--max-seconds-per-rate`, 50 requests at least), fresh ones of the same trace, so the server's cache carries over
from rate to rate as a live service's would.
Systems: `pc-rag modular` and `pc-rag exact` (`pc-rag serve`, plain text), `pc-rag modular marked` (the same
documents as content parts with `cache_control`: what an app that hands the documents over gets), `pc-rag
modular first sight` (plain text, `pc-rag serve --passages-from-first-sight`), `vllm`
(vLLM's OpenAI server, prefix caching on) and `llamacpp` (llama-cpp-python's server) from `--peers`
(benchmarks/peers_env.sh). Records per rate TTFT p50/p90/p99, inter-token latency, output tokens/s, the prompt
tokens the server reports as cached (where it reports them), refused and lost requests; per system the highest
rate under the SLO; for pc-rag, whether greedy answers under load equal a one-at-a-time replay of the same
requests on the same server. serving.json: `systems.<name>.max_rate_rps`, `systems.<name>.rates[]`; serving.md
and serving.png (TTFT p99 against rate). `--ttft-limit S` starts the pc-rag servers with that first-token limit
(pc_rag/serve/admission.py): past saturation they refuse with a 429 what would come late, and a rate with any
refusal does not count as held.

`--trace documents`: the corpus as Python's documentation is (`corpus_documents`: whole paragraphs, blank lines
inside a document, so an app's plain text holds several passages per document) and questions of 15-40 tokens.
Per rate, beside the TTFTs: the tokens the server computed per request on its path (prompt tokens less cached ones,
from `usage`), and, for pc-rag, the encode forwards per request on requests' paths and after replies and the tokens
encoded after replies (its /health's encode counters, before and after the rate).

Concurrency (`--concurrency 1 8 32`): the KV bytes that many requests hold at once over one `--prefix-tokens`
system text, in process (`concurrency`): serving.json `concurrency.<n>.kv_bytes`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pc_rag.blocks import KVBlock
from pc_rag.serve.process import ChildProcess, ServerProcess
from pc_rag.store.memory import POLICIES, MemoryStore

TOKENS_PER_WORD = 1.3  # the bench tokenizer on Python's documentation, near enough for sizes


@dataclass(frozen=True)
class Request:
    t_s: float  # arrival time
    chunks: tuple[int, ...]  # corpus indexes, in prompt order
    question: str
    turn: int  # 0: a new question; > 0: a follow-up in the same conversation
    index: int = -1  # in the trace
    parent: int | None = None  # the trace index of the request a follow-up continues


def corpus_documents(n: int, words_per_chunk: int = 190) -> list[str]:
    """`n` documents of Python's documentation as it is: whole paragraphs (blank lines between them, hard-wrapped
    lines kept) of its topics, gathered until one has ~`words_per_chunk` words (~250 tokens; one long paragraph
    may make it longer), in the order of the topics (repeated if short). A retriever's chunks of a real corpus: an
    app joining them with blank lines sends several passages per document (docs/design.md, "Passages")."""
    from pydoc_data.topics import topics

    docs, current, words = [], [], 0
    for k in sorted(topics):
        for paragraph in topics[k].strip().split("\n\n"):
            if not paragraph.strip():
                continue
            current.append(paragraph.rstrip())
            words += len(paragraph.split())
            if words >= words_per_chunk:
                docs.append("\n\n".join(current))
                current, words = [], 0
    return [docs[i % len(docs)] + ("" if i < len(docs) else f" ({i // len(docs)})") for i in range(n)]


def corpus_chunks(n: int, words_per_chunk: int = 190) -> list[str]:
    """`n` chunks of Python's documentation, ~250 tokens each, in the order of its topics (repeated if short)."""
    from pydoc_data.topics import topics

    words = " ".join(" ".join(topics[k].split()) for k in sorted(topics)).split(" ")
    chunks = [" ".join(words[i: i + words_per_chunk]) for i in range(0, len(words) - words_per_chunk, words_per_chunk)]
    return [chunks[i % len(chunks)] + ("" if i < len(chunks) else f" ({i // len(chunks)})") for i in range(n)]


def rag_trace(n_chunks: int, n_requests: int, alpha: float, seed: int = 0, follow_ups: float = 0.1,
              question_words: tuple[int, int] | None = None) -> list[Request]:
    """Questions over a corpus of `n_chunks` with Zipf(`alpha`) document popularity: each retrieves 4-8 chunks,
    drawn by popularity without repeats, in a random order; a `follow_ups` share continues an earlier question.
    `question_words` (lo, hi): each question that many words drawn from a list of the corpus' terms after a fixed
    opening (15-40 tokens on the bench tokenizer for (1, 20)); None: one fixed sentence numbered per question."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** alpha for rank in range(n_chunks)]
    ranks = list(range(n_chunks))
    rng.shuffle(ranks)  # popularity independent of corpus order
    out: list[Request] = []
    for i in range(n_requests):
        if out and rng.random() < follow_ups:
            prev = rng.choice(out[-50:])
            out.append(Request(0.0, prev.chunks, f"And then? ({i})", prev.turn + 1, i, prev.index))
            continue
        k = rng.randint(4, 8)
        picked: list[int] = []
        while len(picked) < k:
            c = ranks[rng.choices(range(n_chunks), weights)[0]]
            if c not in picked:
                picked.append(c)
        out.append(Request(0.0, tuple(picked), _question(rng, i, question_words), 0, i))
    return out


_WORDS = ("loop", "iterator", "exception", "handler", "class", "method", "attribute", "module", "import", "scope",
          "closure", "generator", "yield", "context", "manager", "descriptor", "slot", "operator", "expression",
          "statement", "assignment", "argument", "keyword", "default", "value", "object", "sequence", "mapping",
          "string", "format", "encoding", "buffer", "file", "thread", "lock", "signal", "frame", "traceback",
          "name", "binding", "global", "nonlocal", "lambda", "comprehension", "decorator", "annotation", "type")


def _question(rng: random.Random, i: int, words: tuple[int, int] | None) -> str:
    if words is None:
        return f"Question {i}: what does the documentation say about it?"
    picked = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*words)))
    return f"Question {i}: what does it say about the {picked}?"


def arrivals(trace: list[Request], rate_rps: float, seed: int = 0) -> list[Request]:
    """The trace with Poisson arrival times at `rate_rps`."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in trace:
        t += rng.expovariate(rate_rps)
        out.append(replace(r, t_s=t))
    return out


def _block(tokens: int, layers: int = 2) -> KVBlock:
    k = torch.zeros(layers, 1, tokens, 1)
    return KVBlock(k, k, tuple(range(tokens)), 0)


def eviction(chunks: list[str], trace: list[Request], budget: float, policy: str) -> dict:
    tokens = [max(1, round(len(c.split(" ")) * TOKENS_PER_WORD)) for c in chunks]
    size = _block(1).nbytes
    total = sum(tokens) * size
    store = MemoryStore(max_bytes=int(budget * total), policy=policy)
    hit = asked = 0
    for r in trace:
        for c in r.chunks:
            key = f"chunk-{c:040x}"
            asked += tokens[c]
            if store.get(key) is not None:
                hit += tokens[c]
            else:
                store.put(key, _block(tokens[c]))
    return {"hit_ratio": hit / asked, "evictions": store.tier_stats()[0].evictions}


def bounds(chunks: list[str], trace: list[Request], budget: float, alpha: float) -> dict:
    """What no policy can beat on this trace: "static", the chunks most popular by the trace's own Zipf law kept
    for good (the best any frequency-based policy can learn); "belady", a clairvoyant that, when a block must
    leave, drops the one used again farthest in the future (Belady's MIN, by uses, not sizes: an upper bound
    within a few points for blocks of near-equal size)."""
    tokens = [max(1, round(len(c.split(" ")) * TOKENS_PER_WORD)) for c in chunks]
    cap = budget * sum(tokens)
    asked = sum(tokens[c] for r in trace for c in r.chunks)
    counts: dict[int, int] = {}
    for r in trace:
        for c in r.chunks:
            counts[c] = counts.get(c, 0) + 1
    kept, used = set(), 0
    for c in sorted(counts, key=lambda c: -counts[c]):
        if used + tokens[c] <= cap:
            kept.add(c)
            used += tokens[c]
    static = sum(tokens[c] for r in trace for c in r.chunks if c in kept) / asked
    uses = [c for r in trace for c in r.chunks]
    following: list[int] = [0] * len(uses)
    last: dict[int, int] = {}
    for i in range(len(uses) - 1, -1, -1):
        following[i] = last.get(uses[i], len(uses))
        last[uses[i]] = i
    held: dict[int, int] = {}  # chunk -> index of its next use
    used = hit = 0
    for i, c in enumerate(uses):
        if c in held:
            hit += tokens[c]
        else:
            used += tokens[c]
        held[c] = following[i]
        while used > cap:
            out = max(held, key=held.get)
            used -= tokens[out]
            del held[out]
    return {"static": static, "belady": hit / asked}


# ---- load: the trace sent to servers -----------------------------------------------------------------------------
SYSTEM = "You answer questions about Python from the documents the user gives. Be brief."
PC_RAG_SYSTEMS = ("pc-rag modular", "pc-rag exact", "pc-rag modular marked", "pc-rag modular first sight")
PEER_SYSTEMS = ("vllm", "llamacpp")


def messages(req: Request, chunks: list[str], marked: bool, earlier: list[dict] | None = None) -> list[dict]:
    """What an app sends: the documents as plain text in the user message (or, `marked`, as content parts with
    `cache_control`, the way an app that hands its documents over sends them); `earlier`: a follow-up's
    conversation so far."""
    if earlier is not None:
        return [*earlier, {"role": "user", "content": req.question}]
    docs = [chunks[c] for c in req.chunks]
    if marked:
        parts = [{"type": "text", "text": "Documents:\n\n"}]
        for d in docs:
            parts += [{"type": "text", "text": d, "cache_control": {"type": "ephemeral"}},
                      {"type": "text", "text": "\n\n"}]
        content: str | list = [*parts, {"type": "text", "text": f"Question: {req.question}"}]
    else:
        content = "Documents:\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {req.question}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))] if values else float("nan")


async def send_rate(url: str, trace: list[Request], chunks: list[str], marked: bool, extra_body: dict,
                    max_tokens: list[int], timeout_s: float,
                    history: dict[int, list[dict]]) -> tuple[list[dict], float]:
    """Every request of `trace` at its arrival time (seconds from now), streamed. A follow-up sends its
    conversation so far (`history`: trace index -> the messages sent and the answer, filled as answers come); one
    whose parent is in this part waits for that answer (a user reads before asking again) and is sent then or at
    its own time, whichever is later; one whose parent got no answer starts a conversation of its own. Returns one
    record per request and the wall time."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=timeout_s)
    done = {r.index: asyncio.Event() for r in trace}
    records: list[dict] = [{} for _ in trace]
    t0 = time.perf_counter()

    async def one(i: int, req: Request) -> None:
        await asyncio.sleep(max(0.0, req.t_s - (time.perf_counter() - t0)))
        if req.parent in done:
            await done[req.parent].wait()
        sent = messages(req, chunks, marked, history.get(req.parent) if req.parent is not None else None)
        start = time.perf_counter()
        first, stamps, text, usage = None, [], [], None
        try:
            stream = await client.chat.completions.create(
                model="m", messages=sent, max_tokens=max_tokens[i], temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra_body)
            async for event in stream:
                if event.choices and event.choices[0].delta.content:
                    now = time.perf_counter()
                    first = first or now
                    stamps.append(now)
                    text.append(event.choices[0].delta.content)
                if event.usage is not None:
                    usage = event.usage
            end = time.perf_counter()
            details = getattr(usage, "prompt_tokens_details", None) if usage else None
            answer = "".join(text)
            history[req.index] = [*sent, {"role": "assistant", "content": answer}]
            records[i] = {"ttft_s": (first or end) - start, "total_s": end - start,
                          "itl_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
                          "prompt_tokens": usage.prompt_tokens if usage else 0,
                          "completion_tokens": usage.completion_tokens if usage else len(stamps),
                          "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else None,
                          "answer": answer, "turn": req.turn}
        except Exception as e:  # counted: a refusal (429/503) or a lost answer
            status = getattr(e, "status_code", None)
            records[i] = {"error": f"{type(e).__name__}: {str(e)[:200]}", "refused": status in (429, 503)}
        finally:
            done[req.index].set()

    await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    wall = time.perf_counter() - t0
    await client.close()
    return records, wall


def summarize(rate: float, records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if "error" not in r]
    ttft = [r["ttft_s"] for r in ok]
    itl = [r["itl_s"] for r in ok if r["itl_s"] is not None]
    cached = [r for r in ok if r["cached_tokens"] is not None]
    return {"rate": rate, "requests": len(records), "answered": len(ok),
            "refused": sum(1 for r in records if r.get("refused")),
            "lost": sum(1 for r in records if "error" in r and not r.get("refused")),
            "errors": sorted({r["error"] for r in records if "error" in r})[:3],
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
            "itl_mean_s": statistics.fmean(itl) if itl else None,
            "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / wall_s,
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else 0,
            "hit_ratio": (sum(r["cached_tokens"] for r in cached) / max(1, sum(r["prompt_tokens"] for r in cached))
                          if cached else None),
            # what the server computed on the request's path (chunks and passages it encoded count as computed)
            "computed_tokens_mean": (statistics.fmean(r["prompt_tokens"] - r["cached_tokens"] for r in cached)
                                     if cached else None),
            "wall_s": wall_s}


class PeerServer(ChildProcess):
    """A peer's OpenAI server in a child process on a free port, in its own virtualenv under --peers; `cmd` names
    the port as "{port}"."""

    log_prefix = "serving_peer_"

    def __init__(self, name: str, cmd: list[str], env: dict):
        super().__init__()
        self.name, self.env = name, env
        self.cmd = [c.replace("{port}", str(self.port)) for c in cmd]

    def start(self) -> None:
        import urllib.request

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_tail()}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=5).read()
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /v1/models within 600 s")


def peer_server(name: str, peers: Path, model: Path, max_len: int, work: Path) -> PeerServer | None:
    from .peers import gguf, peer_python

    python = peer_python(peers, name)
    if python is None:
        return None
    threads = str(os.cpu_count() or 1)
    env = dict(os.environ)
    if name == "vllm":
        tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
        if os.path.exists(tcmalloc):  # vLLM's CPU docs ask for it
            env["LD_PRELOAD"] = tcmalloc
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{int(threads) - 1}")
        return PeerServer(name, [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--served-model-name", "m", "--port", "{port}", "--dtype", "float32",
                                 "--enable-prefix-caching", "--enable-prompt-tokens-details",  # its cached share
                                 "--max-model-len", str(max_len),
                                 "--no-enable-log-requests"], env)
    if subprocess.run([str(python), "-c", "import llama_cpp.server"], capture_output=True).returncode:
        print("[serving] llamacpp: llama_cpp.server does not import (pip install 'llama-cpp-python[server]' "
              "in its venv); skipped", file=sys.stderr)
        return None
    path = gguf(peers, model, "float32", work)
    if path is None:
        return None
    return PeerServer(name, [str(python), "-m", "llama_cpp.server", "--model", str(path), "--model_alias", "m",
                             "--port", "{port}", "--n_ctx", str(max_len), "--n_threads", threads,
                             "--n_threads_batch", threads], env)


def replay_equal(url: str, trace: list[Request], chunks: list[str], marked: bool, extra_body: dict,
                 max_tokens: list[int], records: list[dict], n: int = 12) -> float:
    """Share of `n` answered first-turn requests whose greedy answer under load equals the same request sent
    alone afterwards to the same server (the engine's cache state then differs only by what later requests
    added)."""
    picked = [i for i, r in enumerate(trace) if r.turn == 0 and "answer" in records[i]][:n]
    if not picked:
        return float("nan")
    same = 0
    for i in picked:
        alone = [replace(trace[i], t_s=0.0)]
        rec, _ = asyncio.run(send_rate(url, alone, chunks, marked, extra_body, [max_tokens[i]], 600, {}))
        same += rec[0].get("answer") == records[i]["answer"]
    return same / len(picked)


def encodes_of(server) -> dict | None:
    """The server's encode counters (pc-rag serve's /health: `Engine.stats()["encodes"]`), None for a peer."""
    return server.health().get("encodes") if isinstance(server, ServerProcess) else None


def encodes_per_request(before: dict | None, after: dict | None, requests: int) -> dict:
    """What a rate's requests encoded on their own, per request: forwards on requests' paths and after replies, and
    the tokens encoded after replies (not in `computed_tokens_mean`, which counts the request's path)."""
    if before is None or after is None:
        return {}
    diff = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in ("request", "after_reply")}
    return {"encode_forwards_per_request": diff["request"]["forwards"] / requests,
            "after_reply_forwards_per_request": diff["after_reply"]["forwards"] / requests,
            "after_reply_tokens_per_request": diff["after_reply"]["tokens"] / requests}


def run_system(name: str, server, trace: list[Request], chunks: list[str], args) -> dict:
    marked = name.endswith("marked")
    extra = {"mode": name.split()[1]} if name.startswith("pc-rag") else {}
    rng = random.Random(args.seed + 1)
    max_tokens = [rng.randint(*args.answer_tokens) for _ in trace]
    rows, rate = [], args.rates[0]
    with server:
        warm = [Request(0.0, (0, 1, 2, 3), "A warm-up question.", 0)]  # load, allocator, kernels: outside timing
        asyncio.run(send_rate(server.url, warm, chunks, marked, extra, [8], 600, {}))
        history: dict[int, list[dict]] = {}
        offset = args.warm_requests
        # A service in its steady state: the trace's first requests, one at a time and unmeasured, fill every
        # system's caches (pc_rag's store and passage index, vLLM's prefix cache) before the rates are measured.
        for i, req in enumerate(trace[:offset]):
            asyncio.run(send_rate(server.url, [replace(req, t_s=0.0)], chunks, marked, extra, [max_tokens[i]],
                                  args.timeout, history))
        step = 2.0  # up while the SLO holds; where the first rate fails, down until one holds
        listed = list(args.rate_list or [])  # exactly these rates, instead of stepping
        if listed:
            rate = listed.pop(0)
        while args.min_rate <= rate <= args.max_rate:
            # Below 1 req/s fewer requests, so that a rate's arrivals span at most --max-seconds-per-rate.
            count = min(args.requests_per_rate, max(50, round(rate * args.max_seconds_per_rate)))
            if offset + count > len(trace):
                break
            part = arrivals(trace[offset:offset + count], rate, args.seed + offset)
            before = encodes_of(server)
            records, wall = asyncio.run(send_rate(server.url, part, chunks, marked, extra,
                                                  max_tokens[offset:offset + len(part)], args.timeout, history))
            row = summarize(rate, records, wall)
            row.update(encodes_per_request(before, encodes_of(server), len(part)))
            if name.startswith("pc-rag") and args.replay:
                row["equal_to_one_at_a_time"] = replay_equal(server.url, part, chunks, marked, extra,
                                                             max_tokens[offset:offset + len(part)], records)
            rows.append(row)
            print(f"[serving] {name:22} {rate:6.2f} req/s: TTFT p50 {row['ttft_p50_s']:.2f} s p99 "
                  f"{row['ttft_p99_s']:.2f} s  {row['output_tokens_per_s']:.0f} tok/s  cached "
                  f"{row['hit_ratio'] if row['hit_ratio'] is None else round(row['hit_ratio'], 3)}  refused "
                  f"{row['refused']} lost {row['lost']}", flush=True)
            offset += len(part)
            held = row["ttft_p99_s"] <= args.slo and row["answered"] == len(part)
            if args.rate_list:
                if not listed:
                    break
                rate = listed.pop(0)
                continue
            if len(rows) == 1 and not held:
                step = 0.5
            elif held != (step > 1):
                break  # going up: past saturation (this rate is twice the highest that held); down: one held
            rate *= step
    good = [r["rate"] for r in rows if r["ttft_p99_s"] <= args.slo and r["answered"] == r["requests"]]
    return {"max_rate_rps": max(good) if good else 0.0, "rates": rows}


def load(args, out: Path) -> dict:
    from .common import model_or_bench

    model = Path(model_or_bench(args.model, out))
    chunks = (corpus_documents if args.trace == "documents" else corpus_chunks)(args.chunks, args.chunk_words)
    n = args.requests_per_rate * 8 + args.warm_requests
    trace = rag_trace(args.chunks, n, args.alpha, args.seed,
                      question_words=(1, 20) if args.trace == "documents" else None)
    peers = Path(args.peers) if args.peers else None
    systems = {}
    for name in args.systems or [*PC_RAG_SYSTEMS, *PEER_SYSTEMS]:
        if name in PC_RAG_SYSTEMS:
            cache = tempfile.mkdtemp(prefix="serving_cache_")
            server = ServerProcess(model, extra=["--cache-dir", cache, "--max-waiting", "100000", "--queue-timeout",
                                                 str(args.timeout), "--prefill-timeout", str(args.timeout),
                                                 "--served-model-name", "m",
                                                 *(["--passages-from-first-sight"] if name.endswith("first sight")
                                                   else []),
                                                 *(["--ttft-limit", str(args.ttft_limit)] if args.ttft_limit else [])])
        elif name in PEER_SYSTEMS and peers is not None:
            server = peer_server(name, peers, model, 4096, out)
            if server is None:
                print(f"[serving] {name}: not found under {peers} (benchmarks/peers_env.sh); skipped", file=sys.stderr)
                continue
        else:
            continue
        systems[name] = run_system(name, server, trace, chunks, args)
        (out / "serving.partial.json").write_text(json.dumps(systems, indent=1))  # a long run keeps what it has
    return {"model": model.name, "trace": args.trace, "alpha": args.alpha, "slo_s": args.slo,
            "requests_per_rate": args.requests_per_rate, "warm_requests": args.warm_requests,
            "chunks": args.chunks, "ttft_limit_s": args.ttft_limit, "answer_tokens": list(args.answer_tokens),
            "systems": systems}


def concurrency(model: Path, counts: list[int], prefix_tokens: int, max_new_tokens: int = 24) -> dict:
    """KV memory of `n` requests at once over one shared prefix of `prefix_tokens` (a system text every request
    starts with), for each n in `counts`: each request decodes its first token, then every one waits until all n
    have theirs, so the n are live together, and what they hold then is summed: the request buffers (the runner's
    acquired and not yet released ones; a buffer taken from the pool counts whole) and the shared prefixes they
    read in place (model/cache.py). Beside it, the prefix's own KV by the formula (2 x layers x tokens x kv_heads x
    head_dim x bytes), so `prefix_copies` is the total in prefixes' worth. The store's copy of the blocks is
    counted apart (`store_bytes`)."""
    import threading

    from pc_rag import Engine

    engine = Engine.from_pretrained(str(model))
    engine.max_batch = max(counts)  # every request of the largest n decodes as a row at once
    runner = engine.runner
    live: dict[int, object] = {}  # the request buffers out now
    lock = threading.Lock()
    acquire, release = runner.acquire_cache, runner.release_cache

    def acquired(*a, **kw):
        cache = acquire(*a, **kw)
        with lock:
            live[id(cache)] = cache
        return cache

    def released(cache):
        with lock:
            live.pop(id(cache), None)
        release(cache)

    runner.acquire_cache, runner.release_cache = acquired, released
    words = " ".join(corpus_chunks(40))
    system = engine.tokenizer.decode(engine.tokenizer(words, add_special_tokens=False)["input_ids"][:prefix_tokens])
    engine.generate(system + "\n\nWarm-up question.", mode="exact", max_new_tokens=1)  # the prefix stored once
    per_token = runner.shape.kv_bytes_per_token(runner.dtype)
    prefix_bytes = per_token * len(engine.tokenizer(system, add_special_tokens=False)["input_ids"])
    out = {}
    for n in counts:
        gate = threading.Barrier(n, timeout=600)
        held: list[int] = []

        def one(i: int, gate: threading.Barrier, held: list[int]) -> None:
            pieces = engine.stream(system + f"\n\nQuestion {i}: what does it say?", mode="exact",
                                   max_new_tokens=max_new_tokens)
            next(pieces)
            if gate.wait() == 0:  # one thread reads the total while all n hold their buffers
                with lock:
                    held.append((sum(c.nbytes for c in live.values()) + runner.shared_stats()["in_use_bytes"],
                                 sum(c.base is not None for c in live.values())))
            gate.wait()
            for _ in pieces:
                pass

        threads = [threading.Thread(target=one, args=(i, gate, held)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store = sum(t.bytes_held for t in engine.store.tier_stats() if t.name == "memory")
        (kv, reading), = held
        out[str(n)] = {"kv_bytes": kv, "prefix_kv_bytes": prefix_bytes, "prefix_copies": kv / prefix_bytes,
                       "reading_shared": reading, "shared_prefixes": runner.shared_stats()["prefixes"],
                       "store_bytes": store, "wall_s": time.perf_counter() - t0}
        print(f"[serving] {n} concurrent requests over a {prefix_tokens}-token prefix: KV {kv / 2**20:.1f} MiB = "
              f"{kv / prefix_bytes:.1f}x the prefix's; {reading} of {n} read a shared prefix", file=sys.stderr)
    return out


def markdown(result: dict) -> str:
    answers = "-".join(map(str, sorted(set(result.get("answer_tokens", [32, 64])))))
    kind = ("documents with paragraphs, questions of 15-40 tokens" if result.get("trace") == "documents"
            else "one-paragraph chunks")
    lines = [f"Trace: {result['chunks']} chunks ({kind}), Zipf alpha {result['alpha']}, 4-8 chunks per question, "
             f"answers of {answers} tokens, "
             f"{result['requests_per_rate']} requests per rate"
             + (f" after {result['warm_requests']} unmeasured ones, one at a time (a warm cache)"
                if result.get("warm_requests") else "") + f", SLO: TTFT p99 <= {result['slo_s']:g} s; model "
             f"{result['model']}, CPU.", "",
             "| system | highest rate under the SLO (req/s) | rate | TTFT p50 / p90 / p99 (s) | inter-token (ms) "
             "| output tok/s | cached share | computed tok/req | encode fwd/req (path + after reply) "
             "| refused / lost | equal to one at a time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, sys_ in result["systems"].items():
        for i, r in enumerate(sys_["rates"]):
            hit = "" if r["hit_ratio"] is None else f"{r['hit_ratio']:.2f}"
            itl = "" if r["itl_mean_s"] is None else f"{r['itl_mean_s'] * 1000:.0f}"
            eq = r.get("equal_to_one_at_a_time")
            computed = "" if r.get("computed_tokens_mean") is None else f"{r['computed_tokens_mean']:.0f}"
            forwards = ("" if "encode_forwards_per_request" not in r else
                        f"{r['encode_forwards_per_request']:.2f} + {r['after_reply_forwards_per_request']:.2f}")
            lines.append(f"| {name if i == 0 else ''} | {sys_['max_rate_rps'] if i == 0 else ''} | {r['rate']:g} | "
                         f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} / {r['ttft_p99_s']:.2f} | {itl} | "
                         f"{r['output_tokens_per_s']:.0f} | {hit} | {computed} | {forwards} | "
                         f"{r['refused']} / {r['lost']} | {'' if eq is None else f'{eq:.2f}'} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, sys_ in result["systems"].items():
        rates = sys_["rates"]
        ax.plot([r["rate"] for r in rates], [r["ttft_p99_s"] for r in rates], marker="o", label=f"{name} (p99)")
    ax.axhline(result["slo_s"], color="grey", ls="--", lw=1, label="SLO")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_title(f"RAG trace (Zipf {result['alpha']}), {result['model']}, CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--chunks", type=int, default=1200)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--chunk-words", type=int, default=190, help="words per chunk (~1.3 bench tokens each)")
    ap.add_argument("--trace", choices=("flat", "documents"), default="flat",
                    help="flat: each chunk one paragraph, one fixed question; documents: Python's documentation as it "
                         "is (paragraphs, blank lines inside), questions of 15-40 tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", nargs="*", choices=[*PC_RAG_SYSTEMS, *PEER_SYSTEMS],
                    help="servers to load (default: every pc-rag one, and the peers found under --peers); "
                         "none given with the option: the eviction part only")
    ap.add_argument("--peers", help="the peers' virtualenvs (benchmarks/peers_env.sh DIR)")
    ap.add_argument("--model", help="checkpoint dir (default: the offline bench Llama, built under --out)")
    ap.add_argument("--alpha", type=float, default=1.1, help="Zipf popularity of the load trace")
    ap.add_argument("--rates", type=float, nargs=1, default=[1.0], help="the first arrival rate (req/s); doubled")
    ap.add_argument("--max-rate", type=float, default=64.0)
    ap.add_argument("--rate-list", type=float, nargs="*", help="measure exactly these rates, in order (no stepping)")
    ap.add_argument("--answer-tokens", type=int, nargs=2, default=[32, 64], metavar=("LO", "HI"),
                    help="each answer's max_tokens, drawn in [LO, HI] per request (the issue's first table: 16 16)")
    ap.add_argument("--min-rate", type=float, default=0.125, help="where a first rate that fails steps down to")
    ap.add_argument("--requests-per-rate", type=int, default=200)
    ap.add_argument("--warm-requests", type=int, default=0,
                    help="send the trace's first N requests one at a time, unmeasured, before the rates (a warm cache)")
    ap.add_argument("--max-seconds-per-rate", type=float, default=240.0,
                    help="fewer requests at a rate whose arrivals would span longer (at least 50)")
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT p99 bound in seconds")
    ap.add_argument("--timeout", type=float, default=900.0, help="a request's client timeout in seconds")
    ap.add_argument("--ttft-limit", type=float, default=None,
                    help="start pc-rag serve with --ttft-limit S (refused requests count against the SLO)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32],
                    help="KV held by this many requests at once over one prefix (none: skipped)")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="the shared prefix of --concurrency")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip the one-at-a-time replay that checks greedy answers under load")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chunks = corpus_chunks(args.chunks, args.chunk_words)
    result = {"chunks": args.chunks, "requests": args.requests, "budget": args.budget, "eviction": {}}
    print(f"memory tier at {args.budget:.0%} of the corpus' KV; share of chunk tokens found in memory")
    print("alpha  " + "  ".join(f"{p:>6}" for p in POLICIES) + "  static  belady   (bounds: no policy does better)")
    for alpha in (0.8, 1.1):
        trace = rag_trace(args.chunks, args.requests, alpha, args.seed)
        row = {p: eviction(chunks, trace, args.budget, p) for p in POLICIES}
        for p, r in row.items():
            result["eviction"].setdefault(p, {})[str(alpha)] = r
        limit = bounds(chunks, trace, args.budget, alpha)
        result.setdefault("eviction_bounds", {})[str(alpha)] = limit
        print(f"{alpha:<5}  " + "  ".join(f"{row[p]['hit_ratio']:6.3f}" for p in POLICIES)
              + f"  {limit['static']:6.3f}  {limit['belady']:6.3f}")
    if args.concurrency:
        from .common import model_or_bench

        model = Path(model_or_bench(args.model, out))
        result["concurrency"] = concurrency(model, args.concurrency, args.prefix_tokens)
    if args.systems is None or args.systems:
        result["load"] = load(args, out)
        (out / "serving.md").write_text(markdown(result["load"]))
        plot(result["load"], out / "serving.png")
        print(markdown(result["load"]))
        result["systems"] = result["load"]["systems"]
    (out / "serving.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
