"""Cached KV from the persistent tiers: prefetch on retrieval, and compressed (int8) blocks.

    python -m benchmarks.loads --model bench_out/bench-model --lengths 4096 8192 --reps 5 --out bench_out

1. Prefetch. A LangChain retrieval chain (retriever -> stuff -> chat prompt -> ChatPromptCache, modular)
   whose chunks' KV is on disk. TTFT is measured from the LLM call (the engine's `ttft_s`, in the reply's
   response_metadata), with the end-to-end chain time next to it, in four conditions: the KV warm in memory;
   from disk (memory emptied before each request, prefetch off); from disk with prefetch (memory emptied,
   the retriever's documents prefetched when the hook sees them); the same behind a 25 ms step between the
   retriever and the prompt (a reranker's time: what a prefetch can hide when it has time). Also the gap
   between the retriever's end and the LLM call: the time a prefetch has before the request needs the blocks.
   A new question each time, so the question is always computed.
2. Compressed blocks. The same chunks stored bit-exact and as int8 (keys per channel, values per token),
   on disk and in Redis: bytes per token (file sizes) against 2*L*H_kv*D*b, modular TTFT warm from each tier
   with the load steps (read, verify, dequantize), and the fidelity cost on this model: mean KL(full ‖ mode)
   of the next-token distribution, top-1 agreement with full, and KL(modular ‖ modular int8), over
   --fidelity-prompts prompts of 4 chunks (fidelity.py's unrelated and consecutive sets). Accuracy on the
   trained retrieval model: `python -m benchmarks.accuracy --codec int8`.
Writes loads.json and loads.md under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import pc_rag

from .common import Workload, build_prompt, corpus_chunks, interleaved, load_steps, local_redis, model_or_bench
from .fidelity import chunk_sets, kl

SYSTEM = "Answer the question from the context.\n\n{context}"


RERANK_S = 0.025


def prefetch_chain(engine, chunks, reps):
    """TTFT from the LLM call and end-to-end chain time (median ms) per condition, and the retrieval gap."""
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_pc_rag import ChatPromptCache

    class ListRetriever(BaseRetriever):
        documents: list[Document]

        def _get_relevant_documents(self, query, *, run_manager):
            return self.documents

    class Gap(BaseCallbackHandler):
        """Time from the retriever's end to the chat model's start."""

        def __init__(self):
            self.retrieved = self.called = 0.0

        def on_retriever_end(self, documents, **kwargs):
            self.retrieved = time.perf_counter()

        def on_chat_model_start(self, serialized, messages, **kwargs):
            self.called = time.perf_counter()

    def rerank(ds):  # a reranker's time between the retriever and the prompt (a cross-encoder: tens of ms)
        time.sleep(RERANK_S)
        return ds

    docs = [Document(page_content=c.strip()) for c in chunks]  # retrievers return stripped page contents
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{input}")])
    llm = ChatPromptCache(engine=engine, mode="modular", max_tokens=1)

    def chain_with(*steps):
        return {"context": ListRetriever(documents=docs).pipe(*steps, lambda ds: "\n\n".join(d.page_content
                                                                                        for d in ds)),
                "input": lambda q: q} | prompt | llm

    chain, reranked = chain_with(), chain_with(rerank)
    memory = engine.store.tiers[0]
    gap = Gap()
    chain.invoke("Which statement is described?")  # encodes the chunks: memory and disk
    counter = iter(range(10**6))
    conditions = ("memory", "disk", "disk_prefetch", "disk_prefetch_rerank")
    samples = {c: {"ttft_ms": [], "chain_ms": [], "gap_ms": [], "cached_tokens": []} for c in conditions}
    for i in range(reps + 1):  # the conditions in turn (a shared machine's load moves them alike); round 0 warms up
        for condition in conditions:
            engine.prefetch_on_discover = condition.startswith("disk_prefetch")
            if condition == "memory":
                chain.invoke(f"Question {next(counter)}: warm-up")  # the previous condition emptied memory
            else:
                memory.clear()
                engine.runner.forget_held()  # nor in the pooled buffers: the blocks come from disk
            question = f"Question {next(counter)}: which statement does the documentation describe?"
            t0 = time.perf_counter()
            msg = (reranked if condition == "disk_prefetch_rerank" else chain).invoke(question,
                                                                                     config={"callbacks": [gap]})
            t1 = time.perf_counter()
            pc_rag.prefetch.wait_idle(30)
            if i:
                got = samples[condition]
                got["ttft_ms"].append(msg.response_metadata["ttft_s"] * 1000)
                got["chain_ms"].append((t1 - t0) * 1000)
                got["gap_ms"].append((gap.called - gap.retrieved) * 1000)
                got["cached_tokens"].append(msg.usage_metadata["input_token_details"].get("cache_read", 0))
    out = {c: {k: statistics.median(v) for k, v in samples[c].items()} for c in conditions}
    engine.prefetch_on_discover = True
    out["prefetch_over_memory"] = out["disk_prefetch"]["ttft_ms"] / out["memory"]["ttft_ms"]
    out["prefetch_rerank_over_memory"] = out["disk_prefetch_rerank"]["ttft_ms"] / out["memory"]["ttft_ms"]
    return out


def compressed_ttft(w, stores, reps):
    """Modular TTFT warm from each persistent tier (memory emptied first; the blocks were copied there
    beforehand), measured in turn with the ideal (common.interleaved), then each tier's load steps. `stores`:
    name -> (engine, memory tier, persistent tier)."""
    def request(e):  # a one-token generate: its ttft_s leaves out what follows the reply (storing, promoting)
        return lambda: e.generate(w.prompt, mode="modular", max_new_tokens=1)

    def steps(e):  # the logits alone: load_steps times every step up to them
        return lambda: e.next_token_logits(w.prompt, mode="modular")

    cases = {"ideal": w.ideal_case()} | {name: (request(e), memory.clear) for name, (e, memory, _) in stores.items()}
    times = interleaved(cases, reps)
    rows = {name: {"ttft": times[name], "steps": load_steps(e, tier, steps(e), reps, memory.clear)}
            for name, (e, memory, tier) in stores.items()}
    return times["ideal"], rows


def fidelity(engines, sets):
    """Mean KL(full ‖ mode), top-1 agreement with full, and KL(modular ‖ mode) over the prompts, per engine
    name (each engine reads its chunks from its own persistent tier, memory emptied first)."""
    base = next(iter(engines.values()))[0]
    acc = {name: {"kl_full": [], "top1": [], "kl_modular": [], "top1_modular": []} for name in engines}
    for chunks in sets:
        prompt = build_prompt(chunks)
        full = base.next_token_logits(prompt, mode="full")
        logits = {}
        for name, (e, memory) in engines.items():
            e.warm(chunks, progress=False)  # encodes into this engine's tiers (the int8 one stores int8)
            memory.clear()  # so the request reads the chunks back from the persistent tier
            e.runner.forget_held()
            e.planner.prefixes.clear()
            logits[name] = e.next_token_logits(prompt, mode="modular")
        ref = logits["none"]
        for name, lg in logits.items():
            a = acc[name]
            a["kl_full"].append(kl(full, lg))
            a["top1"].append(int(full.argmax() == lg.argmax()))
            a["kl_modular"].append(kl(ref, lg))
            a["top1_modular"].append(int(ref.argmax() == lg.argmax()))
    return {name: {k: statistics.mean(v) for k, v in a.items()} | {"kl_full_max": max(a["kl_full"])}
            for name, a in acc.items()}


def run(model_path, lengths, reps, fidelity_prompts=24, redis="auto", seed=0):
    tmp = Path(tempfile.mkdtemp(prefix="pc_rag_bench_loads_"))
    try:
        with local_redis(redis) as redis_url:
            return _run(model_path, lengths, reps, fidelity_prompts, redis_url, seed, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(model_path, lengths, reps, fidelity_prompts, redis_url, seed, tmp):
    engine = pc_rag.Engine.from_pretrained(model_path, store=["memory:16GiB", f"disk:{tmp / 'none'}?max_bytes=64GiB"])
    model, tok = engine.model, engine.tokenizer

    def sibling(*specs):
        e = pc_rag.Engine(model, tok, store=["memory:16GiB", *specs])
        return e, *e.store.tiers

    stores = {"disk": (engine, *engine.store.tiers),
              "disk int8": sibling(f"disk:{tmp / 'int8'}?max_bytes=64GiB&compress=int8")}
    if redis_url is not None:
        sep = "&" if "?" in redis_url else "?"
        stores["redis"] = sibling(f"{redis_url}{sep}prefix=none:")
        stores["redis int8"] = sibling(f"{redis_url}{sep}prefix=int8:&compress=int8")
    pool = corpus_chunks(engine)
    rng = random.Random(seed)
    shape = engine.runner.shape
    result = {"model": str(model_path), "date": time.strftime("%Y-%m-%d"), "reps": reps,
              "machine": f"{torch.get_num_threads()} torch threads", "rows": [],
              "formula_bytes_per_token": {"float32": shape.kv_bytes_per_token(torch.float32),
                                          "bfloat16": shape.kv_bytes_per_token(torch.bfloat16)}}
    for target in lengths:
        k = max(1, (target - 60) // 260)
        w = Workload(engine, rng.sample(pool, k))
        engine.store.clear()
        engine.warm(w.chunks, progress=False)
        row = {"prompt_tokens": len(w.ids)}
        disk = engine.store.tiers[1]
        keys = list(disk._index)
        tokens = sum(disk.get(key).num_tokens for key in keys)
        for _, _, tier in stores.values():
            if tier is not disk:
                tier.clear()
                for key in keys:
                    tier.put(key, disk.get(key))
        row["bytes_per_token"] = {}
        for name in ("disk", "disk int8"):
            files = stores[name][2].blocks_dir.glob("kv-*.safetensors")
            row["bytes_per_token"][name] = sum(f.stat().st_size for f in files) / tokens
        row["ideal"], row["tiers"] = compressed_ttft(w, stores, reps)
        row["prefetch"] = prefetch_chain(engine, w.chunks, reps)
        result["rows"].append(row)
        print(json.dumps({"prompt_tokens": row["prompt_tokens"], "prefetch": row["prefetch"],
                          "bytes_per_token": row["bytes_per_token"], "ideal": row["ideal"],
                          "tiers": {name: t["ttft"] for name, t in row["tiers"].items()}}), flush=True)
    if not fidelity_prompts:
        return result
    sets = [c for kind in ("unrelated", "consecutive")
            for c in chunk_sets(engine, kind, fidelity_prompts // 2, 4, 200, rng)]
    result["fidelity"] = fidelity({"none": (engine, stores["disk"][1]),
                                   "int8": (stores["disk int8"][0], stores["disk int8"][1])}, sets)
    result["fidelity_prompts"] = len(sets)
    return result


def markdown(r):
    f32, bf16 = r["formula_bytes_per_token"]["float32"], r["formula_bytes_per_token"]["bfloat16"]
    lines = [f"Model: {r['model']}; {r['machine']}; {r['date']}; median of {r['reps']} runs, milliseconds.", "",
             "Prefetch on retrieval (LangChain chain, modular; TTFT from the LLM call; the gap is the time from the "
             "retriever's end to the LLM call; \"reranked\": the same chain with a "
             f"{RERANK_S * 1000:.0f} ms step between the retriever and the prompt, as a reranker would take):", "",
             "| prompt tokens | memory warm TTFT | disk TTFT | disk + prefetch TTFT | prefetch / memory "
             "| reranked: disk + prefetch TTFT | reranked: prefetch / memory "
             "| chain memory | chain disk | chain disk + prefetch | gap |", "|---" * 11 + "|"]
    for row in r["rows"]:
        p = row["prefetch"]
        rr = p.get("disk_prefetch_rerank", {}).get("ttft_ms", float("nan"))
        lines.append(f"| {row['prompt_tokens']} | {p['memory']['ttft_ms']:.1f} | {p['disk']['ttft_ms']:.1f} "
                     f"| {p['disk_prefetch']['ttft_ms']:.1f} | {p['prefetch_over_memory']:.2f} "
                     f"| {rr:.1f} | {p.get('prefetch_rerank_over_memory', float('nan')):.2f} "
                     f"| {p['memory']['chain_ms']:.1f} | {p['disk']['chain_ms']:.1f} "
                     f"| {p['disk_prefetch']['chain_ms']:.1f} | {p['disk_prefetch']['gap_ms']:.1f} |")
    names = list(r["rows"][0]["tiers"])
    lines += ["", f"Compressed blocks: modular TTFT warm from each tier (memory emptied first) against the ideal; "
              f"bytes per token stored (formula: {f32} in float32, {bf16} in bfloat16):", "",
              "| prompt tokens | ideal | " + " | ".join(names) + " | bytes/token | bytes/token int8 "
              "| int8 / bf16 formula |", "|---" * (len(names) + 5) + "|"]
    for row in r["rows"]:
        ideal = row["ideal"]["median_s"] * 1000
        ms = [row["tiers"][n]["ttft"]["median_s"] * 1000 for n in names]
        cells = [f"{t:.1f} ({t / ideal:.2f}x)" for t in ms]
        b = row["bytes_per_token"]
        lines.append(f"| {row['prompt_tokens']} | {ideal:.1f} | " + " | ".join(cells)
                     + f" | {b['disk']:.0f} | {b['disk int8']:.0f} | {b['disk int8'] / bf16:.3f} |")
    lines += ["", "Load steps (median ms per request; sums over blocks read in parallel):", "",
              "| prompt tokens | tier | TTFT | tier wall | open | read | verify | dequantize | copy | forward "
              "| MB read |",
              "|---" * 11 + "|"]
    for row in r["rows"]:
        for n in names:
            st = row["tiers"][n]["steps"]
            cells = [st[k] for k in ("ttft_ms", "load_ms", "open_ms", "read_ms", "verify_ms", "decode_ms", "copy_ms",
                                     "forward_ms")]
            lines.append(f"| {row['prompt_tokens']} | {n} | " + " | ".join(f"{c:.1f}" for c in cells)
                         + f" | {st['bytes_read'] / 1e6:.1f} |")
    fid = r.get("fidelity")
    if fid is None:  # --fidelity-prompts 0
        return "\n".join(lines) + "\n"
    lines += ["", f"Fidelity on this model ({r['fidelity_prompts']} prompts of 4 chunks of 200 tokens, chunks read "
              "from disk):", "", "| blocks | mean KL(full ‖ modular) | max | top-1 agreement with full "
              "| KL(modular ‖ this) | top-1 agreement with modular |", "|---|---|---|---|---|---|"]
    for name, f in fid.items():
        lines.append(f"| {name} | {f['kl_full']:.3e} | {f['kl_full_max']:.3e} | {f['top1']:.2f} "
                     f"| {f['kl_modular']:.2e} | {f['top1_modular']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the offline 'bench' Llama under --out)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fidelity-prompts", type=int, default=24)
    ap.add_argument("--redis", default="auto", help="Redis URL; 'auto' starts a local redis-server; 'none' skips")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = model_or_bench(args.model, out)
    result = run(model, args.lengths, args.reps, args.fidelity_prompts, args.redis)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loads.json").write_text(json.dumps(result, indent=2))
    (out / "loads.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
