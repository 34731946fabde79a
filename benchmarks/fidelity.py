"""Answer fidelity per mode against `full`: how far does reuse move the model's output?

    python -m benchmarks.fidelity --prompts 12 --chunks 4 --out bench_out

For each prompt (a system text, k chunks, a question) and each mode, against `full` on the same tokens:
- KL(full || mode) of the next-token distribution after the prompt,
- top-1 agreement of that distribution,
- the length of the identical greedy prefix over --new-tokens generated tokens.
Two chunk sets: "unrelated" (k random chunks of the corpus) and "consecutive" (one document cut into k
consecutive chunks, so each chunk continues the previous one: the case where independent encoding loses
the most context). Modes: exact (must be identical), modular (chunks encoded after a BOS sink, the
default), modular without the sink (each chunk encoded from position 0 with nothing before it: the
measurement behind the sink), modular with the "\n\n" separators between chunks computed fresh instead of
reused (the measurement behind reusing them), blend at several recompute ratios with both selections (CacheBlend's
layer-1 key deviation, and the first tokens of each chunk), and the prompt's chunks declared as a scaffold.

The default model is the offline `bench` Llama with random weights: it measures how much the computation
moves, not answer quality. Pass --model for a real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import pc_rag
from pc_rag.assemble import Assembler
from pc_rag.store import MemoryStore

from .common import build_prompt, common_prefix, model_or_bench

RATIOS = (0.05, 0.15, 0.3)


def kl(full_logits, logits):
    p = full_logits.log_softmax(-1)
    return float(torch.sum(p.exp() * (p - logits.log_softmax(-1))))


def chunk_sets(engine, kind, n, k, tokens_per_chunk, rng):
    docs = [d for d in pc_rag.testing.pydoc_corpus() if len(engine.segmenter.ids(d)) > k * tokens_per_chunk]
    pieces = []
    for d in docs:
        ids = engine.segmenter.ids(d)
        pieces.append([engine.tokenizer.decode(ids[i * tokens_per_chunk:(i + 1) * tokens_per_chunk]) for i in range(k)])
    if kind == "consecutive":
        return [pieces[i] for i in rng.sample(range(len(pieces)), n)]
    flat = [c for p in pieces for c in p]
    return [rng.sample(flat, k) for _ in range(n)]


@dataclass(frozen=True)
class Variant:
    name: str
    mode: str
    ratio: float = 0.0
    select: str = "deviation"
    nosink: bool = False
    scaffold: bool = False


# exact last: its prefix nodes (the whole prompt but the question) would otherwise serve the others too.
VARIANTS = [Variant("modular", "modular"), Variant("modular_nosink", "modular", nosink=True)]
VARIANTS += [Variant(f"blend_{r}_{sel}", "blend", r, sel) for sel in ("deviation", "chunk_start", "progressive")
             for r in RATIOS]
VARIANTS += [Variant("scaffold", "modular", scaffold=True), Variant("exact", "exact")]


def measure(engine, nosink, prompts, new_tokens):
    rows = []
    default = engine.assembler
    for chunks in prompts:
        prompt = build_prompt(chunks)
        full = engine.generate(prompt, mode="full", max_new_tokens=new_tokens)
        lf = engine.next_token_logits(prompt, "full")
        row = {}
        for v in VARIANTS:
            engine.assembler = nosink if v.nosink else default
            engine.blend_selection = v.select
            if v.scaffold:
                engine.add_scaffold(chunks)  # the group, declared in this prompt's order
            try:
                # Chunks are first seen in another request, in another order, as in real RAG traffic;
                # for exact and the scaffold, the same prompt ran before (that is what they reuse).
                warmup = prompt if v.mode == "exact" or v.scaffold else build_prompt(chunks[::-1])
                engine.generate(warmup, mode=v.mode, max_new_tokens=1, recompute_ratio=v.ratio)
                gen = engine.generate(prompt, mode=v.mode, max_new_tokens=new_tokens, recompute_ratio=v.ratio)
                lm = engine.next_token_logits(prompt, v.mode, recompute_ratio=v.ratio)
            finally:
                engine.assembler = default
            row[v.name] = {"kl": kl(lf, lm), "top1": int(lf.argmax() == lm.argmax()),
                           "greedy_prefix": common_prefix(full.token_ids, gen.token_ids),
                           "cached_tokens": gen.cached_tokens}
        engine.planner.scaffolds.clear()
        rows.append(row)
    summary = {}
    for name in rows[0]:
        vals = [r[name] for r in rows]
        summary[name] = {
            "kl_mean": statistics.mean(v["kl"] for v in vals),
            "kl_max": max(v["kl"] for v in vals),
            "top1_agreement": statistics.mean(v["top1"] for v in vals),
            "greedy_prefix_mean": statistics.mean(v["greedy_prefix"] for v in vals),
            "cached_tokens_mean": statistics.mean(v["cached_tokens"] for v in vals),
        }
    return summary


def run(model_path, n, k, tokens_per_chunk, new_tokens, dtype="float32", device="cpu", seed=0):
    engine = pc_rag.Engine.from_pretrained(model_path, dtype=dtype, device=device, store=MemoryStore())
    # The no-sink variant: same model, its own store (keys include the sink, so entries never mix).
    nosink = Assembler(engine.runner, MemoryStore(), ())
    rng = random.Random(seed)
    result = {"model": str(model_path), "dtype": dtype, "prompts": n, "chunks_per_prompt": k,
              "tokens_per_chunk": tokens_per_chunk, "new_tokens": new_tokens, "date": time.strftime("%Y-%m-%d"),
              "sets": {}}
    for kind in ("unrelated", "consecutive"):
        result["sets"][kind] = measure(engine, nosink, chunk_sets(engine, kind, n, k, tokens_per_chunk, rng),
                                       new_tokens)
        print(kind, json.dumps(result["sets"][kind]), flush=True)
    return result


def markdown(result):
    lines = [f"Model: {result['model']}; {result['prompts']} prompts per set, {result['chunks_per_prompt']} chunks "
             f"of {result['tokens_per_chunk']} tokens; greedy prefix over {result['new_tokens']} tokens; "
             f"{result['date']}.", "",
             "| chunk set | mode | mean KL(full‖mode) | max KL | top-1 agreement | identical greedy prefix (mean) |",
             "|---|---|---|---|---|---|"]
    for kind, modes in result["sets"].items():
        for mode, s in modes.items():
            lines.append(f"| {kind} | {mode} | {s['kl_mean']:.2e} | {s['kl_max']:.2e} | {s['top1_agreement']:.2f} "
                         f"| {s['greedy_prefix_mean']:.1f} / {result['new_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the offline 'bench' Llama under --out)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--tokens-per-chunk", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = model_or_bench(args.model, out)
    result = run(model, args.prompts, args.chunks, args.tokens_per_chunk, args.new_tokens, args.dtype, args.device)
    (out / "fidelity.json").write_text(json.dumps(result, indent=2))
    (out / "fidelity.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
