"""What blend costs: TTFT per selection and ratio at about 3.9K tokens, next to full and modular.

    python -m benchmarks.blend_cost --out bench_out            # the offline bench Llama (8 layers), float32

The prompt is common.py's (a system text, 15 chunks of ~256 tokens of real text, a question), every chunk warm in
memory; each case runs in turn, one run per round (`common.interleaved`), so load drift on a shared machine moves
all cases alike. Also per case: `work`, the share of a full recompute of the chunk tokens that the selection
computes in context (token-layers, layer 0 included; `assemble.recompute_work`). Pairs with the accuracy table
(`benchmarks/accuracy.py`), which says what each setting recovers. `--ape`: also modular and each blend with
`align="ape"` (APE's attention, pc_rag/align.py: plain torch ops instead of the native kernels; work as without).
Writes blend_cost.json and blend_cost.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import pc_rag
from pc_rag.assemble import recompute_work

from .accuracy import DEFAULT_BLENDS, blend_name, parse_blend
from .common import interleaved, model_or_bench, workloads


def run(model_path, target_tokens: int, blends: list[str], reps: int, seed: int = 0, ape: bool = False) -> dict:
    engine = pc_rag.Engine.from_pretrained(model_path, store="memory:16GiB")
    w = next(workloads(engine, [target_tokens], seed))
    engine.warm(w.chunks, progress=False)
    chunk_tokens = sum(len(engine.segmenter.ids(c)) for c in w.chunks)
    layers = engine.runner.shape.num_layers

    def case(mode, spec=None, align=None):
        ratio, select = parse_blend(spec) if spec else (0.0, engine.blend_selection)

        def fn():
            engine.blend_selection = select
            engine.next_token_logits(w.prompt, mode=mode, recompute_ratio=ratio, align=align)
            # Only the text before the first chunk may be reused as a prefix: drop the rest, so every run
            # computes the same (blend never stores past its first chunk; full and modular would).
            engine.planner.prefixes.clear()
        return fn, None

    cases = {"full": case("full"), "modular": case("modular")}
    if ape:
        cases["modular ape"] = case("modular", align="ape")
    cases.update({blend_name(b): case("blend", b) for b in blends})
    if ape:
        cases.update({blend_name(b) + " ape": case("blend", b, "ape") for b in blends})
    times = interleaved(cases, reps)
    rows = []
    for name, t in times.items():
        if name == "full":
            work = 1.0
        elif name in ("modular", "modular ape"):
            work = 0.0
        else:
            ratio, select = parse_blend(next(b for b in blends if name in (blend_name(b), blend_name(b) + " ape")))
            work = recompute_work(select, ratio, chunk_tokens, layers)
        rows.append({"case": name, "work": work, **t})
    return {"model": str(model_path), "prompt_tokens": len(w.ids), "chunk_tokens": chunk_tokens, "layers": layers,
            "threads": torch.get_num_threads(), "reps": reps, "rows": rows}


def markdown(result: dict) -> str:
    full = next(r for r in result["rows"] if r["case"] == "full")["median_s"]
    modular = next(r for r in result["rows"] if r["case"] == "modular")["median_s"]
    lines = [f"TTFT at {result['prompt_tokens']} prompt tokens ({result['chunk_tokens']} in chunks, warm in memory), "
             f"`{result['model']}` ({result['layers']} layers), {result['threads']} threads, median of "
             f"{result['reps']}; work: token-layers of the chunk tokens computed in context, as a share of full.",
             "", "| case | work | TTFT ms | share of full's extra time over modular |", "|---|---|---|---|"]
    for r in result["rows"]:
        extra = (r["median_s"] - modular) / (full - modular)
        lines.append(f"| {r['case']} | {r['work']:.2f} | {1e3 * r['median_s']:.1f} | {extra:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the offline bench Llama under --out)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length to aim for")
    ap.add_argument("--blend", nargs="*", default=list(DEFAULT_BLENDS), help="RATIO:SELECTION settings")
    ap.add_argument("--ape", action="store_true", help="also modular and each blend with align='ape'")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    result = run(model_or_bench(args.model, out), args.tokens, args.blend, args.reps, ape=args.ape)
    (out / "blend_cost.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "blend_cost.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
