"""Write the measured tables (docs/results.md) from the benchmark JSON files.

    python -m benchmarks.ttft --out bench_out && python -m benchmarks.fidelity --out bench_out
    python -m benchmarks.report --out bench_out

Replaces the text between the `results` markers in docs/results.md and draws the TTFT plot into docs/ttft.png.
The README's short summary of them is kept by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import accuracy, blend_cost, fidelity, loads, prefix, ttft

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"


def section(out: Path) -> str:
    parts = []
    t = json.loads((out / "ttft.json").read_text())
    rows = t["rows"]
    best = max(rows, key=lambda r: r["prompt_tokens"])
    parts.append(
        "### Time to first token\n\n"
        f"At {best['prompt_tokens']} prompt tokens, `modular` with every chunk warm in memory answers "
        f"{best['speedup_modular_vs_hf_full']:.1f}x faster than an HF full prefill, at "
        f"{best['modular_over_ideal']:.2f}x the ideal (the question alone over a ready cache). The warm "
        "columns repeat the same prompt, so since automatic prefix reuse the question itself is found in the "
        "cache too and only the last token is computed: that is why warm memory runs below the ideal; the "
        "repeated-system-prompt table below measures a new question per request against the same ideal. "
        "Decode is the same loop in every mode: reuse only shortens the prefill; decode rates are measured "
        "over 32 tokens on a shared 2-core machine.\n\n"
        + ttft.markdown(t)
        + "\n![TTFT against prompt length](ttft.png)\n"
    )
    l_path = out / "loads.json"
    if l_path.exists():
        parts.append(
            "### Loading from disk and Redis: prefetch and compressed blocks\n\n"
            "`benchmarks/loads.py`: a LangChain retrieval chain with its chunks' KV on disk, TTFT from the LLM call "
            "with and without prefetch on retrieval; int8 blocks against exact ones (bytes, load time, fidelity "
            "cost). See docs/store.md for what each column measures.\n\n"
            + loads.markdown(json.loads(l_path.read_text()))
        )
    p_path = out / "prefix.json"
    if p_path.exists():
        p = json.loads(p_path.read_text())
        parts.append(
            "### Automatic prefix reuse: TTFT of a repeated system prompt\n\n"
            "The everyday case of prompt caching, with nothing registered: a repeated system prompt and a new "
            "question per request, sent as one plain string (`benchmarks/prefix.py`). From memory the reuse is "
            "token-exact; a new process on the same disk folder finds whole blocks only, so it recomputes up to "
            "block_tokens - 1 tokens (\"lost to block rounding\"). The default block size is 32. Disk entries: "
            "the prompt's blocks except its last 256-511 tokens are stored in extents of 8 blocks, one entry each "
            "(docs/store.md, \"Extents\").\n\n"
            + prefix.markdown(p)
        )
    fl_path = out / "flows.json"
    if fl_path.exists():
        parts.append(flows_section(json.loads(fl_path.read_text())))
    f_path = out / "fidelity.json"
    if f_path.exists():
        f = json.loads(f_path.read_text())
        parts.append(
            "### Fidelity against `full`\n\n"
            "How far each mode moves the next-token distribution and the greedy continuation, on the same "
            "model (random weights: this measures how much the computation moves, not answer quality). "
            "`exact` must show zero. Unrelated chunks are random corpus chunks; consecutive chunks are one "
            "document cut in pieces.\n\n" + fidelity.markdown(f)
        )
    bc_path = out / "blend_cost.json"
    if bc_path.exists():
        parts.append("### Blend: cost\n\n`benchmarks/blend_cost.py`: what each blend setting costs at about 4K "
                     "tokens on the bench model, next to full and modular (what each recovers: the trained "
                     "model's table below).\n\n" + blend_cost.markdown(json.loads(bc_path.read_text())))
    runs = sorted((ROOT / "benchmarks" / "retrieval-results").glob("accuracy-seed*.json"))
    if runs:
        parts.append(accuracy_section([json.loads(r.read_text()) for r in runs]))
    deep = sorted((ROOT / "benchmarks" / "deep-retrieval-results").glob("accuracy-seed*.json"))
    if deep:
        parts.append(deep_section([json.loads(r.read_text()) for r in deep],
                                  [json.loads(r.read_text()) for r in runs]))
    parts.append(
        "Reproduce the rest (`pip install -e \".[bench]\"` for the plot): "
        "`python -m benchmarks.ttft --lengths 1024 2048 4096 8192 --reps 5 --out bench_out && "
        "python -m benchmarks.prefix --reps 7 --out bench_out && "
        "python -m benchmarks.flows --out bench_out/flows.json && "
        "python -m benchmarks.fidelity --prompts 12 --out bench_out && python -m benchmarks.loads --out bench_out && "
        "python -m benchmarks.blend_cost --out bench_out && "
        "python -m benchmarks.report --out bench_out` "
        "(`pc-rag bench` runs the first)."
    )
    return "\n".join(parts)


def accuracy_section(results: list[dict]) -> str:
    """The trained model's answer accuracy per mode: seeds pooled, then the share recovered per seed."""
    stages = training_stages(ROOT / "benchmarks" / "retrieval-model" / "training_log.json")
    steps = sum(st["steps"] for st in stages)
    minutes = sum(st["minutes"] for st in stages)
    pooled = accuracy.pool(results)
    seeds = ", ".join(str(r["seed"]) for r in results)
    per_seed = pooled["rows"][0]["prompts"] // len(results)
    blends = [m for m in pooled["modes"] if m.startswith("blend")]
    lines = [
        "### Answer accuracy of a trained model\n",
        f"A 0.6M-parameter Llama (4 layers, word-level tokenizer) trained on this CPU for {minutes:.0f} minutes "
        f"({steps:,} steps in {len(stages)} stages, `benchmarks/train_retrieval.py`) on synthetic retrieval: single "
        "hop (`417 is the code of Bako .` among distractor chunks) and two hop (`Raso works with Dimu .` in one "
        "chunk, Dimu's code in another; half the prompts also hold Raso's own code). Full-mode accuracy shows what "
        "it learned. Encoding chunks independently (`modular`) costs two hop far more than single hop, the "
        "paper's finding that multi-hop suffers most. "
        f"{per_seed:,} held-out prompts per row on each of {len(results)} seeds ({seeds}), pooled below "
        f"(N = {pooled['rows'][0]['prompts']:,}: one answer is {100 / pooled['rows'][0]['prompts']:.2f} point); "
        "`modular int8` reads every chunk block back from a disk tier storing compressed blocks.\n",
        accuracy.markdown(pooled),
        "Share of modular's two-hop loss recovered, per seed (the spread between seeds is the noise of the "
        "table above):\n",
        "| chunks | " + " | ".join(f"{m}, seed {r['seed']}" for m in [*blends, "scaffold"] for r in results) + " |",
        "|---|" + "---|" * (len(blends) + 1) * len(results),
    ]
    for row in pooled["rows"]:
        if row["task"] != "two_hop":
            continue
        cells = []
        for m in [*blends, "scaffold"]:
            for r in results:
                one = next(x for x in r["rows"] if (x["task"], x["chunks"]) == (row["task"], row["chunks"]))
                got = accuracy.recovered(one, m)
                cells.append("–" if got is None else f"{100 * got:.0f}%")
        lines.append(f"| {row['chunks']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Reproduce (stage by stage; each `--init` is the previous stage's output):\n",
        "".join(f"    python -m benchmarks.train_retrieval {st['command']}\n" for st in stages)
        + "".join(f"    python -m benchmarks.accuracy --model benchmarks/retrieval-model --prompts {per_seed} "
                  f"--chunks {' '.join(str(c) for c in sorted({x['chunks'] for x in pooled['rows']}))} --seed "
                  f"{r['seed']} --codec int8 --out benchmarks/retrieval-results\n" for r in results),
    ]
    return "\n".join(lines)


def deep_section(results: list[dict], shallow: list[dict]) -> str:
    """The deeper testbed (8 layers, grown from the 4-layer model): accuracy per mode, then beside the 4-layer
    model the share of modular's two-hop loss each blend setting recovers and its work."""
    record = json.loads((ROOT / "benchmarks" / "deep-retrieval-model" / "training_log.json").read_text())
    args, last = record["args"], record["log"][-1]
    final = {t: f"{100 * v:.0f}%" for t, v in last["acc_max_chunks"].items()}
    pooled = accuracy.pool(results)
    seeds = ", ".join(str(r["seed"]) for r in results)
    n = pooled["rows"][0]["prompts"]
    cut = last["step"] < args["max_steps"]
    lines = [
        "### A deeper trained testbed (8 layers)\n",
        f"`benchmarks/deep-retrieval-model`: 8 layers, hidden {args['hidden']}, {args['heads']} query and "
        f"{args['kv_heads']} key/value heads (GQA), RoPE, 5.6M parameters, 22 MB. Grown from the 4-layer model "
        "(`benchmarks/grow.py`: new layers and width start at zero output, so the grown model first computes what "
        "the small one did) and trained on this CPU for "
        f"{last['minutes']:.0f} minutes ({last['step']} steps of {args['batch']} sequences"
        + (f", cut short of the {args['max_steps']} its schedule planned" if cut else "")
        + ", under `nice -n 19` on a machine shared with other sessions' test suites) on single hop, two hop and "
        "the alias task: `Bako is the alias of Dimu .` in one chunk and, always in a later one, `417 is the code "
        "of Bako .`; the question asks the code of Dimu, so the chunk holding the answer names an entity only an "
        "earlier chunk defines. Held-out accuracy at 4 chunks in training's last evaluation: "
        + ", ".join(f"{TASK_NAMES.get(t, t)} {v}" for t, v in final.items())
        + f". {n:,} held-out prompts per row (seeds {seeds}).\n",
        accuracy.markdown(pooled),
    ]
    if shallow:
        small = accuracy.pool(shallow)
        blends = [m for m in pooled["modes"] if m.startswith("blend") and m in small["modes"]]
        lines += [
            "Beside the 4-layer model (its table above): two hop, share of modular's loss recovered and, in "
            "brackets, the work (token-layers of the chunk tokens computed in context, as a share of a full "
            "recompute):\n",
            "| chunks | model | modular loss | " + " | ".join(blends) + " |",
            "|---|---|---|" + "---|" * len(blends),
        ]
        for k in sorted({r["chunks"] for r in pooled["rows"] if r["task"] == "two_hop"}):
            for name, res in (("4 layers", small), ("8 layers", pooled)):
                row = next((r for r in res["rows"] if (r["task"], r["chunks"]) == ("two_hop", k)), None)
                if row is None:
                    continue
                loss = row["accuracy"]["full"] - row["accuracy"]["modular"]
                cells = [("–" if accuracy.recovered(row, m) is None else f"{100 * accuracy.recovered(row, m):.0f}%")
                         + f" ({row['work'][m]:.2f})" for m in blends]
                lines.append(f"| {k} | {name} | {100 * loss:.1f} points | " + " | ".join(cells) + " |")
        lines.append("")
    opts = {**command_options(record), "--out": "benchmarks/deep-retrieval-model", "--max-minutes": "1000"}
    command = " ".join(f"{k} {v}".strip() for k, v in opts.items())
    chunks = " ".join(str(c) for c in sorted({r["chunks"] for r in pooled["rows"]}))
    tasks = " ".join(dict.fromkeys(r["task"] for r in pooled["rows"]))
    blend_args = " ".join(accuracy_spec(m) for m in pooled["modes"] if m.startswith("blend"))
    lines += [
        "Reproduce:\n",
        f"    python -m benchmarks.train_retrieval {command}\n"
        + "".join(f"    python -m benchmarks.accuracy --model benchmarks/deep-retrieval-model --prompts "
                  f"{n // len(results)} --chunks {chunks} --tasks {tasks} --seed {r['seed']} --blend {blend_args} "
                  "--out benchmarks/deep-retrieval-results\n" for r in results),
    ]
    return "\n".join(lines)


TASK_NAMES = {"single": "single hop", "two_hop": "two hop", "alias": "alias"}


def accuracy_spec(mode: str) -> str:
    """"blend 0.2 progressive" -> "0.2:progressive" (the benchmark's --blend argument)."""
    _, ratio, selection = mode.split()
    return f"{ratio}:{selection}"


def flows_section(report: dict) -> str:
    """The stock LangChain / LlamaIndex flows (only the LLM class swapped): reuse next to its upper bound."""
    lines = [
        "### Reuse in stock LangChain and LlamaIndex flows\n",
        "Each flow is an unchanged LangChain or LlamaIndex app with only the LLM class swapped (no wrapper, no "
        f"registration; `benchmarks/flows.py`, model: {report['model']}, {report['max_new_tokens']} new tokens per "
        "reply). Reuse = cache_read / input_tokens; bound = the share of the request's tokens shared with "
        "earlier requests (the longest common token prefix with any earlier prompt + reply, and in modular "
        "mode the documents seen before); ratio = reuse / bound. A chat's previous reply counts as shared as the "
        "template writes it back (trimmed); the engine stores that form after answering, so chats reuse it. "
        "The flows with low shares (RAG in exact mode, context chat engines) change their prompt early: new "
        "documents right after the system text.\n",
        "| flow | mode | request 2: reuse | bound | ratio | request 3: reuse | bound | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_mode in report["flows"].items():
        for mode, r in by_mode.items():
            later = {t["turn"]: t for t in r["turns"]}
            cells = []
            for n in (2, 3):
                t = later.get(n)
                if t is None:
                    cells += ["", "", ""]
                    continue
                ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
                cells += [f"{t['reuse_share']:.1%}", f"{t['bound_share']:.1%}", ratio]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def command_options(record: dict) -> dict[str, str]:
    """A training record's command line as options; a run cut by --max-minutes stops where it stopped."""
    argv, opts = record["argv"], {}
    for i, flag in enumerate(argv):
        if flag.startswith("--"):
            values = []
            for value in argv[i + 1:]:
                if value.startswith("--"):
                    break
                values.append(value)
            opts[flag] = " ".join(values)
    last = record["log"][-1]
    if last["step"] < record["args"]["max_steps"]:
        opts["--until-step"] = str(last["step"])
    return opts


def training_stages(log_path: Path) -> list[dict]:
    """The training stages behind the committed checkpoint, first first: steps, minutes, and the command."""
    records = []
    record = json.loads(log_path.read_text())
    while record is not None:
        records.append(record)
        record = record.get("init_record")
    stages = []
    for i, record in enumerate(records[::-1], 1):
        last = record["log"][-1]
        if "argv" not in record:  # the first stage predates argv in the log; its run is this command
            opts = {"--threads": "2", "--max-steps": str(last["step"])}
        else:
            opts = command_options(record)
        # the stages' directories as the reader will name them; the last one is the committed checkpoint
        opts["--out"] = "benchmarks/retrieval-model" if i == len(records) else f"STAGE{i}"
        if "--init" in opts:
            opts["--init"] = f"STAGE{i - 1}"
        opts["--max-minutes"] = "1000"  # a time limit is not part of the run
        command = " ".join(f"{k} {v}".strip() for k, v in opts.items())
        stages.append({"steps": last["step"], "minutes": last["minutes"], "command": command})
    return stages


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = ROOT / "docs" / "results.md"
    text = results.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    results.write_text(text[:a] + "\n" + section(out) + "\n" + text[b:])
    ttft.plot(json.loads((out / "ttft.json").read_text()), ROOT / "docs" / "ttft.png")
    print(f"updated {results}")


if __name__ == "__main__":
    main()
