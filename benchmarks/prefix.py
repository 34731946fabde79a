"""Automatic prefix reuse: a repeated ~2K-token system prompt with a new ~30-token question per request.

    python -m benchmarks.prefix --reps 7 --out bench_out

The stock case of prompt caching: plain string prompts, nothing registered. For each prefix block size it
reports the median TTFT (`Generation.ttft_s`, from the call to the first token) of a new question
- from memory: the same engine, every earlier request's blocks in its memory tier and index;
- from disk: a new engine on the same disk folder (as a restarted or second process: empty memory, empty
  index), so only whole blocks are found and up to block_tokens - 1 tokens are recomputed;
next to the ideal (the question alone over a ready HF DynamicCache: the floor no cache can beat) and an HF
full prefill, with the tokens reused, the store entries and bytes per request, and the reuse lost to block
rounding. Writes prefix.json and prefix.md under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import pc_rag
from pc_rag.model.hf import with_cache
from pc_rag.store import DiskStore, MemoryStore, TieredStore

from .common import model_or_bench

BLOCK_SIZES = (16, 32, 64, 128)
QUESTIONS = [f"Question {i}: which of the statements above applies to case number {i * 7 + 3}, and why does it "
             f"hold for value {i * 13 + 5}?\nAnswer:" for i in range(64)]


def system_prompt(engine, tokens: int) -> str:
    text = ""
    for doc in pc_rag.testing.pydoc_corpus():
        text += doc + "\n\n"
        if len(engine.segmenter.ids(text)) >= tokens:
            break
    ids = engine.segmenter.ids(text)[:tokens]
    return "You are a helpful assistant.\n\n" + engine.tokenizer.decode(ids) + "\n\n"


@torch.inference_mode()
def ideal_s(engine, system: str, question: str, reps: int) -> float:
    """The question alone over a ready DynamicCache of the system prompt (cache copies made outside the timing)."""
    model, dev = engine.model, engine.runner.device
    sys_ids = [engine.segmenter.bos_id, *engine.segmenter.ids(system)]
    q_ids = list(engine.segmenter.ids(system + question))[len(sys_ids) - 1:]
    pre = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([sys_ids], device=dev), **with_cache(pre))
    kv = [(layer.keys, layer.values) for layer in pre.layers]
    times = []
    for _ in range(reps + 1):
        cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv])
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([q_ids], device=dev), **with_cache(cache), logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


@torch.inference_mode()
def hf_full_s(engine, text: str, reps: int) -> float:
    ids = torch.tensor([[engine.segmenter.bos_id, *engine.segmenter.ids(text)]], device=engine.runner.device)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        engine.model(input_ids=ids, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(model, tokenizer, system: str, block: int, reps: int, mode: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="pc_rag_prefix_bench_"))
    try:
        def engine():
            e = pc_rag.Engine(model, tokenizer, store=TieredStore([MemoryStore(), DiskStore(folder)]))
            e.planner.block_tokens = block
            return e

        warm = engine()
        first = warm.generate(system + QUESTIONS[0], mode=mode, max_new_tokens=1)
        memory, disk, cached_memory, cached_disk, stored = [], [], [], [], []
        for i in range(1, reps + 2):  # the first request of each kind is a warm-up, not counted
            g = warm.generate(system + QUESTIONS[i], mode=mode, max_new_tokens=1)
            if i > 1:
                memory.append(g.ttft_s)
                cached_memory.append(g.cached_tokens)
                stored.append(g.stored_tokens)
        for i in range(reps + 1):
            fresh = engine()  # a restarted process: empty memory tier and index, the same disk folder
            g = fresh.generate(system + QUESTIONS[reps + 2 + i], mode=mode, max_new_tokens=1)
            if i:
                disk.append(g.ttft_s)
                cached_disk.append(g.cached_tokens)
        tiers = {s.name: s for s in warm.store.tier_stats()}
        return {
            "block_tokens": block, "mode": mode, "prompt_tokens": first.prompt_tokens,
            "memory_ttft_s": statistics.median(memory), "disk_ttft_s": statistics.median(disk),
            "cached_memory": statistics.median(cached_memory), "cached_disk": statistics.median(cached_disk),
            "stored_tokens_per_request": statistics.median(stored),
            "disk_entries": tiers["disk"].entries, "disk_bytes": tiers["disk"].bytes_held,
            "requests": 2 + reps,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(model_path, system_tokens: int, reps: int, blocks=BLOCK_SIZES, modes=("exact", "modular")) -> dict:
    base = pc_rag.Engine.from_pretrained(model_path, store="memory")
    system = system_prompt(base, system_tokens)
    q_tokens = len(base.segmenter.ids(system + QUESTIONS[1])) - len(base.segmenter.ids(system))
    result = {
        "model": str(model_path), "date": time.strftime("%Y-%m-%d"), "reps": reps,
        "threads": torch.get_num_threads(), "system_tokens": len(base.segmenter.ids(system)) + 1,
        "question_tokens": q_tokens,
        "ideal_s": ideal_s(base, system, QUESTIONS[1], reps),
        "hf_full_s": hf_full_s(base, system + QUESTIONS[1], reps),
        "rows": [],
    }
    for mode in modes:
        for block in blocks:
            row = measure(base.model, base.tokenizer, system, block, reps, mode)
            row["memory_over_ideal"] = row["memory_ttft_s"] / result["ideal_s"]
            row["disk_over_ideal"] = row["disk_ttft_s"] / result["ideal_s"]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    return result


def markdown(result) -> str:
    lines = [
        f"Model: {result['model']}; {result['system_tokens']}-token system prompt (plain string, nothing "
        f"registered) + a new ~{result['question_tokens']}-token question per request; {result['threads']} torch "
        f"threads; {result['date']}; median of {result['reps']} requests. Ideal (question alone over a ready "
        f"cache): {result['ideal_s'] * 1000:.1f} ms; HF full prefill: {result['hf_full_s'] * 1000:.1f} ms.",
        "",
        "| mode | block tokens | TTFT from memory (ms) | / ideal | tokens reused | TTFT from disk, new process (ms) "
        "| / ideal | tokens reused | lost to block rounding | disk entries after all requests | stored tokens per "
        "request |",
        "|---" * 11 + "|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['block_tokens']} | {r['memory_ttft_s'] * 1000:.1f} | {r['memory_over_ideal']:.2f} "
            f"| {r['cached_memory']:.0f} | {r['disk_ttft_s'] * 1000:.1f} | {r['disk_over_ideal']:.2f} "
            f"| {r['cached_disk']:.0f} | {r['cached_memory'] - r['cached_disk']:.0f} | {r['disk_entries']} "
            f"| {r['stored_tokens_per_request']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the offline 'bench' Llama under --out)")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--blocks", type=int, nargs="+", default=list(BLOCK_SIZES))
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = model_or_bench(args.model, out)
    result = run(model, args.system_tokens, args.reps, tuple(args.blocks))
    (out / "prefix.json").write_text(json.dumps(result, indent=2))
    (out / "prefix.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
