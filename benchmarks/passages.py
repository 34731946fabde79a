"""Documents an app joins into its prompt itself: how much is reused, what it costs (docs/design.md, "Passages").

    python -m benchmarks.passages [--model PATH | --size tiny|bench] [--out DIR] [--skip server langchain]
                                  [--reps 5] [--overhead-tokens 8192]

Four measurements, each printed as a table and written to DIR/passages.json:

1. flows: three ways apps send retrieved documents as plain text, each asked three questions whose retrieved sets
   overlap in new orders, on a fresh cache namespace: `Engine.generate(one string)`, LangChain 1.x's RAG chain
   (`create_agent(model, tools=[], middleware=[@dynamic_prompt])`, the middleware joining what the vector store's
   `similarity_search` returned into the system message) and the `openai` client against `pc-rag serve` (the app
   writing its own system message). Varied: 3-8 documents of ~100-600 tokens; joined by blank lines, `---`,
   `[n]` labels, `<doc>` tags, LlamaIndex metadata lines. Per request from the second on: the reusable tokens
   (the longest common token prefix with an earlier prompt, plus every document that appeared in an earlier
   prompt of the flow) and the share of them reused (cached_tokens / reusable; cached tokens outside them, such
   as the blank lines between reused documents, are not counted).
2. server TTFT: reordered RAG through `pc-rag serve` (streamed, TTFT as the client sees it), the documents as plain
   text against the same documents marked with `cache_control`, every document sent once before; alternating.
3. overhead: a prompt with nothing seen before (`--overhead-tokens` of documents never sent), TTFT with passages
   on against `Engine.reuse_passages = False`, alternating, fresh documents every run.
4. index: the passage index's memory per passage (tracemalloc), and the time to cut a prompt into passages and
   plan it (nothing seen) from 1K to 32K tokens (linear), and for 10^5 tiny paragraphs.
5. encode (`--only encode`): the passages of prompts of five documents of Python's documentation as it is
   (paragraphs, so several passages per document), each encoded on its own after BOS: one forward per passage
   (the loop), all in one batched pass (`Assembler.encode_chunks`), and one causal prefill of the same tokens (the
   bound), alternating, medians over --reps; per prompt, the passages, their tokens and each time over the prefill's.
6. turns (`--only turns`): cold chat turns one at a time through `pc-rag serve` (--size large --dtype bfloat16 for
   the issue's 0.37B shape): each a new conversation, its user message ~`--turn-tokens` of documentation with
   paragraphs and a question, alternating `modular` and `exact`, each sent as soon as the one before it ended. Two
   clients: one reads the first token and closes the stream (a TTFT probe: the next request arrives while the
   server finishes the one before), one reads to the end. Medians per mode and modular over exact: what a
   reply's leftovers (its new passages' encodes, request.py) cost the next request. `--server-src DIR` runs the
   server from another source tree (an A/B against another checkout, same client and prompts).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import pc_rag
from pc_rag.passages import PassageIndex, passage_spans
from pc_rag.store import MemoryStore

from .common import common_prefix, model_or_bench

SEPARATORS = {
    "blank": lambda docs: "\n\n".join(docs),
    "dashes": lambda docs: "\n---\n".join(docs),
    "numbered": lambda docs: "\n".join(f"[{n}] {d}" for n, d in enumerate(docs, 1)),
    "tags": lambda docs: "\n".join(f"<doc id=\"{n}\">\n{d}\n</doc>" for n, d in enumerate(docs, 1)),
    "metadata": lambda docs: "\n\n".join(f"file_path: /docs/{n}.txt\n\n{d}" for n, d in enumerate(docs, 1)),
}
HEADER = "You are a helpful assistant. Answer the question using only the documents below.\n\n"
QUESTIONS = ("How does the statement end a loop?", "What does it do inside a function?",
             "When does the clause run?")
# (documents per request, ~tokens per document); flows longer than the model's context are left out
FLOWS = [(3, 100), (5, 300), (3, 600), (8, 200), (8, 600), (4, 150)]


def corpus(engine, tokens: int, n: int, seed: int) -> list[str]:
    """`n` documents of about `tokens` tokens: passages of Python's documentation, one paragraph each, cut at a
    word boundary near the `tokens`-th token."""
    from pydoc_data.topics import topics

    words = " ".join(" ".join(topics[k].split()) for k in sorted(topics)).split(" ")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(words) - 2 * tokens)
        text = " ".join(words[start: start + 2 * tokens])
        offsets = engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        end = offsets[min(tokens, len(offsets)) - 1][1]
        out.append(text[: text.rfind(" ", 0, end) if " " in text[:end] else end])
    return out


def orders(n_docs: int, pool: int, seed: int) -> list[list[int]]:
    """Three retrievals of `n_docs` from `pool` documents: each shares about half with the ones before, in a new
    order (the issue's [0,1,2] -> [3,1,0] -> [2,4,1], generalized)."""
    rng = random.Random(seed)
    first = list(range(n_docs))
    seen = list(first)
    out = [first]
    fresh = iter(range(n_docs, pool))
    for _ in range(2):
        keep = rng.sample(seen, max(1, n_docs // 2 + 1))
        new = [next(fresh) for _ in range(n_docs - len(keep))]
        pick = keep + new
        rng.shuffle(pick)
        seen += new
        out.append(pick)
    return out


def reusable(prompt_ids, segments, earlier_ids, earlier_docs) -> int:
    """Tokens of this prompt an earlier prompt of the flow computed: the longest common prefix with one of them,
    plus the tokens of every document that appeared before (their passages in this prompt's split, after BOS)."""
    prefix = max((common_prefix(prompt_ids, e) for e in earlier_ids), default=0)
    covered = set(range(prefix))
    offset = 1
    for seg in segments:
        n = len(seg.token_ids)
        if seg.passage and seg.text.strip() in earlier_docs:
            covered.update(range(offset, offset + n))
        offset += n
    return len(covered)


# ---- 1. flows -------------------------------------------------------------------------------------------------
def run_flows(model_path, way: str, server=None, seed: int = 0) -> list[dict]:
    model, tok = pc_rag.testing.loaded(str(model_path))
    rows = []
    for f, (n_docs, doc_tokens) in enumerate(FLOWS):
        if n_docs * doc_tokens * 1.2 > model.config.max_position_embeddings:
            continue
        for sep_name, join in SEPARATORS.items():
            engine = pc_rag.Engine(model, tok, store=MemoryStore())
            docs = corpus(engine, doc_tokens, n_docs * 2 + 2, seed + f)
            salt = f"flow-{way}-{f}-{sep_name}"
            earlier_ids: list[tuple[int, ...]] = []
            earlier_docs: set[str] = set()
            asker = _asker(way, engine, server, salt)
            for r, order in enumerate(orders(n_docs, len(docs), seed + f)):
                context = join([docs[i] for i in order])
                question = QUESTIONS[r]
                cached, prompt_tokens, prompt_text = asker(context, question)
                segments = engine.split(prompt_text)
                ids = (engine.tokenizer.bos_token_id,) + tuple(t for s in segments for t in s.token_ids)
                if r:
                    can = reusable(ids, segments, earlier_ids, earlier_docs)
                    rows.append({"way": way, "docs": n_docs, "doc_tokens": doc_tokens, "separator": sep_name,
                                 "request": r + 1, "prompt_tokens": prompt_tokens, "reusable": can,
                                 "cached": cached, "share": min(cached, can) / can if can else 1.0})
                earlier_ids.append(ids)
                earlier_docs.update(docs[i] for i in order)
    return rows


def _asker(way, engine, server, salt):
    """(context, question) -> (cached tokens, prompt tokens, the prompt string the engine was given)."""
    from pc_rag.adapters import render_chat

    def messages(context, question):
        return [{"role": "system", "content": HEADER + context}, {"role": "user", "content": question}]

    if way == "engine":
        def ask(context, question):
            text = HEADER + context + f"\n\nQuestion: {question}\nAnswer:"
            g = engine.generate(text, max_new_tokens=8, cache_salt=salt)
            return g.cached_tokens, g.prompt_tokens, text
        return ask
    if way == "server":
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(context, question):
            got = client.chat.completions.create(model="m", messages=messages(context, question), max_tokens=8,
                                                 temperature=0, extra_body={"cache_salt": salt})
            text = render_chat(engine.tokenizer, messages(context, question))
            return got.usage.prompt_tokens_details.cached_tokens, got.usage.prompt_tokens, text
        return ask
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt
    from langchain_core.messages import AIMessage
    from langchain_pc_rag import ChatPromptCache

    retrieved: list[str] = []

    class VectorStore:  # what the tutorial's InMemoryVectorStore answers: the documents this request retrieves
        def similarity_search(self, query, k=4):
            return list(retrieved)

    store = VectorStore()

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        return HEADER + "".join(store.similarity_search(request.state["messages"][-1].text))

    agent = create_agent(ChatPromptCache(engine=engine, max_tokens=8, cache_salt=salt), tools=[],
                         middleware=[prompt_with_context])

    def ask(context, question):
        retrieved[:] = [context]  # the separator's join is the app's; the middleware adds the header
        out = agent.invoke({"messages": [{"role": "user", "content": question}]})["messages"]
        reply = [m for m in out if isinstance(m, AIMessage)][-1]
        usage = reply.usage_metadata
        return usage["input_token_details"]["cache_read"], usage["input_tokens"], render_chat(
            engine.tokenizer, messages(context, question))
    return ask


# ---- 2. server TTFT: plain text against marked documents --------------------------------------------------------
def run_server_ttft(server, model_path, reps: int, seed: int = 1) -> dict:
    import openai

    model, tok = pc_rag.testing.loaded(str(model_path))
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    docs = corpus(engine, 300, 24, seed)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(seed)

    def ask(picked, marked, salt, question):
        if marked:
            content = [{"type": "text", "text": HEADER}]
            for d in picked:
                content += [{"type": "text", "text": d, "cache_control": {"type": "ephemeral"}},
                            {"type": "text", "text": "\n\n"}]
        else:
            content = HEADER + "\n\n".join(picked)
        t0 = time.perf_counter()
        ttft = None
        for event in client.chat.completions.create(
                model="m", messages=[{"role": "system", "content": content}, {"role": "user", "content": question}],
                max_tokens=4, temperature=0, stream=True, extra_body={"cache_salt": salt}):
            if ttft is None and event.choices and event.choices[0].delta.content:
                ttft = time.perf_counter() - t0
        return ttft if ttft is not None else time.perf_counter() - t0

    for marked, salt in ((False, "ttft-plain"), (True, "ttft-marked")):  # every document sent once
        for i in range(0, len(docs), 4):
            ask(docs[i: i + 4], marked, salt, "warm?")
    times = {"plain": [], "marked": []}
    for r in range(reps):
        picked = rng.sample(docs, 5)
        question = f"Question {r}: what does the text say about item {r * 7}?"
        for name, marked in (("plain", False), ("marked", True)):
            times[name].append(ask(picked, marked, f"ttft-{name}", question))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"reps": reps, "ttft_plain_median_s": med["plain"], "ttft_marked_median_s": med["marked"],
            "ratio_plain_over_marked": med["plain"] / med["marked"], "plain_s": times["plain"],
            "marked_s": times["marked"]}


# ---- 3. overhead with nothing seen before ----------------------------------------------------------------------
def run_overhead(model_path, tokens: int, reps: int, seed: int = 2) -> dict:
    model, tok = pc_rag.testing.loaded(str(model_path))
    on = pc_rag.Engine(model, tok, store=MemoryStore())
    off = pc_rag.Engine(model, tok, store=MemoryStore())
    off.reuse_passages = False
    per_doc = 300
    docs = corpus(on, per_doc, (tokens // per_doc + 1) * (2 * reps + 2), seed)
    it = iter(range(0, len(docs), tokens // per_doc + 1))
    times = {"on": [], "off": []}
    for r in range(reps + 1):
        for name, engine in (("on", on), ("off", off)):
            i = next(it)
            prompt = HEADER + "\n\n".join(docs[i: i + tokens // per_doc + 1]) + "\n\nQuestion: what?\nAnswer:"
            g = engine.generate(prompt, max_new_tokens=1)
            if r:
                times[name].append(g.ttft_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"prompt_tokens": g.prompt_tokens, "reps": reps, "ttft_on_median_s": med["on"],
            "ttft_off_median_s": med["off"], "overhead": med["on"] / med["off"] - 1, "on_s": times["on"],
            "off_s": times["off"]}


# ---- 4. the index and the cut ---------------------------------------------------------------------------------
def run_index(model_path) -> dict:
    n = 100_000
    index = PassageIndex()
    keys = [(f"chunk-{i:040x}", 300) for i in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index.add("tenant", keys)
    per_passage = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    model, tok = pc_rag.testing.loaded(str(model_path))
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    docs = corpus(engine, 300, 200, 3)
    cut = []
    for tokens in (1024, 2048, 4096, 8192, 16384, 32768):
        text = "\n\n".join(docs[: tokens // 300 + 1])
        t0 = time.perf_counter()
        spans = passage_spans(text)
        t1 = time.perf_counter()
        segments = engine.split(text)
        t2 = time.perf_counter()
        cut.append({"tokens": sum(len(s.token_ids) for s in segments), "passages": len(spans),
                    "cut_ms": (t1 - t0) * 1e3, "split_ms": (t2 - t1) * 1e3})
    tiny = "a b\n\n" * 100_000
    t0 = time.perf_counter()
    passage_spans(tiny)
    return {"index_bytes_per_passage": per_passage, "cut": cut,
            "tiny_paragraphs_100k_cut_ms": (time.perf_counter() - t0) * 1e3}


# ---- 6. cold chat turns one at a time ---------------------------------------------------------------------------
def run_turns(model_path, dtype: str, reps: int, turn_tokens: int, server_src: str | None, seed: int = 6) -> dict:
    import os

    import openai

    from pc_rag.serve.process import ServerProcess

    model, tok = pc_rag.testing.loaded(str(model_path))
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    docs = documentation(engine, 6 * (reps + 1) * 2, seed, max_tokens=turn_tokens // 3)
    env = dict(os.environ, PYTHONPATH=server_src) if server_src else None
    result: dict = {"dtype": dtype, "turn_tokens": turn_tokens, "reps": reps, "server_src": server_src}
    with ServerProcess(model_path, extra=["--store", "memory", "--dtype", dtype], env=env) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        turn = iter(range(len(docs) // 3))

        def ask(mode: str, first_only: bool) -> tuple[float, float, int]:
            i = next(turn)
            content = "Notes:\n\n" + "\n\n".join(docs[3 * i: 3 * i + 3]) + f"\n\nQuestion {i}: what do they say?"
            messages = [{"role": "system", "content": "You answer from the notes."},
                        {"role": "user", "content": content}]
            t0 = time.perf_counter()
            ttft, usage = None, None
            stream = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body={"mode": mode})
            for event in stream:
                if ttft is None and event.choices and event.choices[0].delta.content:
                    ttft = time.perf_counter() - t0
                    if first_only:
                        break
                usage = event.usage or usage
            stream.close()
            end = time.perf_counter() - t0
            return ttft if ttft is not None else end, end, usage.prompt_tokens if usage else 0

        for client_kind, first_only in (("first token", True), ("whole reply", False)):
            times: dict[str, list] = {"modular": [], "exact": []}
            for r in range(reps + 1):
                for mode in ("modular", "exact"):
                    got = ask(mode, first_only)
                    if r:  # the first round warms the server up
                        times[mode].append(got)
            med = {m: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v),
                       statistics.median(t[2] for t in v)) for m, v in times.items()}
            result[client_kind] = {
                "prompt_tokens": med["modular"][2],
                "ttft_ms": {m: v[0] * 1e3 for m, v in med.items()},
                "end_ms": {m: v[1] * 1e3 for m, v in med.items()},
                "ttft_modular_over_exact": med["modular"][0] / med["exact"][0],
                "end_modular_over_exact": med["modular"][1] / med["exact"][1],
                "runs_s": {m: [[round(x, 4) for x in t[:2]] for t in v] for m, v in times.items()}}
        result["health"] = server.health()
    return result


# ---- 5. encoding a prompt's passages -------------------------------------------------------------------------
def documentation(engine, n: int, seed: int, max_tokens: int = 600) -> list[str]:
    """`n` documents of Python's documentation as it is (its paragraphs kept, blank lines inside), each its topic's
    first paragraphs up to about `max_tokens` tokens."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    out = []
    for k in random.Random(seed).sample(keys, n):
        paragraphs, tokens = [], 0
        for p in topics[k].strip().split("\n\n"):
            tokens += len(engine.segmenter.ids(p))
            if paragraphs and tokens > max_tokens:
                break
            paragraphs.append(p)
        out.append("\n\n".join(paragraphs))
    return out


def run_encode(model_path, reps: int, prompts: int = 4, seed: int = 4) -> list[dict]:
    model, tok = pc_rag.testing.loaded(str(model_path))
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    sink = list(engine.planner.sink_ids)
    rows = []
    for i in range(prompts):
        prompt = HEADER + "\n\n".join(documentation(engine, 5, seed + i)) + "\n\nQuestion: what does it say?"
        chunks = [(s.token_ids, len(sink), "chunk") for s in engine.split(prompt) if s.passage]
        times = encode_times(engine, chunks, reps)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"prompt": i, "passages": len(chunks), "tokens": sum(len(c) for c, _, _ in chunks),
                     "loop_ms": med["loop"] * 1e3, "batched_ms": med["batched"] * 1e3,
                     "prefill_ms": med["prefill"] * 1e3, "loop_over_prefill": med["loop"] / med["prefill"],
                     "batched_over_prefill": med["batched"] / med["prefill"]})
    return rows


def encode_times(engine, chunks: list, reps: int) -> dict[str, list[float]]:
    """Seconds to encode `chunks` one forward each ("loop"), in one batched pass ("batched"), and to prefill their
    tokens after BOS in one causal forward ("prefill"), alternating, `reps` times after one warm-up round."""
    assembler, runner = engine.assembler, engine.runner
    ids = list(engine.planner.sink_ids) + [t for c, _, _ in chunks for t in c]

    def loop():
        for c in chunks:
            assembler.encode_chunks([c], "other")

    def prefill():
        runner.forward(runner.new_cache(len(ids)), ids, list(range(len(ids))), list(range(len(ids))))

    ways = {"loop": loop, "batched": lambda: assembler.encode_chunks(chunks, "other"), "prefill": prefill}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(reps + 1):
        for name, run in ways.items():
            t0 = time.perf_counter()
            run()
            if r:  # the first round warms the allocator and the kernels
                times[name].append(time.perf_counter() - t0)
    return times


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(_fmt(r[c]).ljust(w) for c, w in zip(cols, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--size", default="tiny", choices=("tiny", "bench", "large"))
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--skip", nargs="*", default=[], choices=("flows", "server", "langchain", "overhead", "index"))
    ap.add_argument("--only", choices=("encode", "turns"), help="run that measurement alone")
    ap.add_argument("--dtype", default="float32", help="the server's dtype (turns)")
    ap.add_argument("--turn-tokens", type=int, default=1024, help="a cold chat turn's documents, in tokens (turns)")
    ap.add_argument("--server-src", help="run the server from this source tree (turns: an A/B against a checkout)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--overhead-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        path = args.model
    elif args.size == "bench":
        path = model_or_bench(None, out)
    elif args.size == "large":
        path = out / "large-model"
        if not (path / "config.json").exists():
            pc_rag.testing.build_tiny_llama(path, size="large")
    else:
        path = out / "tiny-model"
        if not (path / "config.json").exists():
            pc_rag.testing.build_tiny_llama(path, size="tiny")
    result: dict = {"model": str(path)}
    if args.only == "encode":
        result["encode"] = run_encode(path, args.reps)
        print(table(result["encode"], ["prompt", "passages", "tokens", "loop_ms", "batched_ms", "prefill_ms",
                                       "loop_over_prefill", "batched_over_prefill"]))
        (out / "passages-encode.json").write_text(json.dumps(result, indent=1))
        return 0
    if args.only == "turns":
        t = result["turns"] = run_turns(path, args.dtype, args.reps, args.turn_tokens, args.server_src)
        for kind in ("first token", "whole reply"):
            r = t[kind]
            print(f"{kind:12} {r['prompt_tokens']} tokens: TTFT modular {r['ttft_ms']['modular']:.0f} ms, exact "
                  f"{r['ttft_ms']['exact']:.0f} ms ({r['ttft_modular_over_exact']:.2f}x); end modular "
                  f"{r['end_ms']['modular']:.0f} ms, exact {r['end_ms']['exact']:.0f} ms "
                  f"({r['end_modular_over_exact']:.2f}x)")
        (out / "passages-turns.json").write_text(json.dumps(result, indent=1))
        return 0
    server = None
    if "server" not in args.skip:
        from pc_rag.serve.process import ServerProcess

        server = ServerProcess(path, extra=["--store", "memory"]).__enter__()
    try:
        if "flows" not in args.skip:
            ways = ["engine"] + [w for w in ("langchain", "server") if w not in args.skip]
            rows = [row for way in ways for row in run_flows(path, way, server)]
            result["flows"] = rows
            print(table(rows, ["way", "docs", "doc_tokens", "separator", "request", "prompt_tokens", "reusable",
                               "cached", "share"]))
            worst = {w: min(r["share"] for r in rows if r["way"] == w) for w in ways}
            print("lowest share per way:", {w: round(v, 3) for w, v in worst.items()})
            result["flows_lowest_share"] = worst
        if server is not None:
            result["server_ttft"] = run_server_ttft(server, path, args.reps)
            s = result["server_ttft"]
            print(f"server, reordered RAG: TTFT plain text {s['ttft_plain_median_s'] * 1e3:.1f} ms, marked "
                  f"{s['ttft_marked_median_s'] * 1e3:.1f} ms: {s['ratio_plain_over_marked']:.2f}x")
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    if "overhead" not in args.skip:
        o = result["overhead"] = run_overhead(path, args.overhead_tokens, args.reps)
        print(f"nothing seen, {o['prompt_tokens']} tokens: TTFT {o['ttft_on_median_s']:.3f} s with passages, "
              f"{o['ttft_off_median_s']:.3f} s without: {o['overhead'] * 100:+.1f}%")
    if "index" not in args.skip:
        i = result["index"] = run_index(path)
        print(f"index: {i['index_bytes_per_passage']:.0f} bytes per passage; 10^5 tiny paragraphs cut in "
              f"{i['tiny_paragraphs_100k_cut_ms']:.0f} ms")
        print(table(i["cut"], ["tokens", "passages", "cut_ms", "split_ms"]))
    (out / "passages.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
