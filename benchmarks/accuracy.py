"""Answer accuracy per mode on the synthetic retrieval task, with a model trained on it.

    python -m benchmarks.accuracy --model benchmarks/retrieval-model --prompts 200 --chunks 2 4 6 --out bench_out

The model comes from `benchmarks/train_retrieval.py` (benchmarks/retrieval-model, 4 layers; the deeper testbed
benchmarks/deep-retrieval-model, 8 layers, also knows the alias task). Each held-out prompt (see retrieval_task.py) is a
system text, k fact chunks (each its own pc_rag.Chunk) with ";" texts between them, and the question text
last; the answer is one token. Per task (single hop, two hop) and chunk count, the fraction of prompts whose
greedy first token is the right answer, in each mode:
- full: no reuse, the reference (shows that the model learned the task);
- exact: the same prompt reused from the prefix cache (must equal full);
- modular: every chunk from its own cached encoding (it never saw the other chunks);
- blend R S: modular, then a share R of the reused chunk tokens recomputed in context (in the last layer),
  chosen by S (`chunk_start`: the first tokens of each chunk; `deviation`: where cached and fresh keys of layer
  1 differ most; `progressive`: the same, narrowed layer by layer; see pc_rag/assemble.py `tokens_per_layer`);
- auto T: blend with a quality target T (`recompute_target`): its layer-1 probe decides per prompt how many
  chunk tokens to recompute (pc_rag/assemble.py `target_tokens`), so its work varies by prompt (the mean is shown);
  `--auto T:shift` (rows "auto T shift") reads the target from the cheap layer-0 probe instead;
- scaffold: modular with the prompt's chunks declared as a scaffold (encoded jointly, so each sees those
  before it);
- modular int8 (with --codec int8): modular with every chunk block read back from a disk tier that stores
  compressed blocks (8-bit keys and values with scales), i.e. the fidelity cost of compression on top of
  modular;
- modular ape, blend R S ape (with --ape): the same with `align="ape"` (pc_rag/align.py: the question attends to
  the reused chunks with APE's temperature T and scale S), T and S calibrated first on --ape-calibration prompts
  of a stream the rows do not use (--ape-seed; `Engine.calibrate_ape`), or given (--ape-pair T S). No recompute:
  work 0 for modular ape, blend's own for blend ape;
- ape T S (with --ape-sweep T:S ...): modular with APE at that pair, to see the accuracy over the grid.
Also per mode: how often its answer equals full's, the share of modular's loss it recovers ((mode - modular) /
(full - modular)), and for blends the compute: token-layers of the chunk tokens computed in context as a share
of a full recompute (`recompute_work`). Writes accuracy-seed<SEED>.json and .md to --out; `pool` merges
runs on several seeds (benchmarks/report.py shows them pooled).
Held-out prompts come from a random stream (--seed) disjoint from the training and evaluation streams.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

import pc_rag
from pc_rag.assemble import SELECTIONS, recompute_work

from .fidelity import kl
from .retrieval_task import ALL_TASKS, TASKS, chunk_tokens_of, in_prose, make_example, names, token_ids, values

BASE_MODES = ("full", "exact", "modular", "scaffold")
DEFAULT_BLENDS = ("0.2:chunk_start", "0.2:deviation", "0.1:progressive", "0.15:progressive", "0.2:progressive",
                  "0.3:progressive")
DEFAULT_TARGETS = (0.8, 0.9)


def blend_name(spec: str) -> str:
    ratio, selection = parse_blend(spec)
    return f"blend {ratio:g} {selection}"


def parse_blend(spec: str) -> tuple[float, str]:
    ratio, _, selection = spec.partition(":")
    if selection not in SELECTIONS:
        raise SystemExit(f"--blend {spec!r}: expected RATIO:SELECTION, SELECTION one of {', '.join(SELECTIONS)}")
    return float(ratio), selection


TASK_TITLES = {"single": "single hop", "two_hop": "two hop", "alias": "alias"}


def parse_auto(spec: str | float) -> tuple[float, str]:
    """`--auto` T (the target read from layer 1, as `progressive`) or T:shift (from the cheap probe)."""
    target, _, selection = str(spec).partition(":")
    if selection not in ("", "shift"):
        raise SystemExit(f"--auto {spec!r}: expected T or T:shift")
    return float(target), selection or "progressive"


def auto_name(spec: str | float) -> str:
    target, selection = parse_auto(spec)
    return f"auto {target:g}" + (" shift" if selection == "shift" else "")


def answer_logprobs(engine, example, blends: list[str], coded: dict | None = None, targets: list[float | str] = (),
                    recomputed: dict | None = None, ape: bool = False,
                    sweep: list[str] = (), ape_blends: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Per mode, the log-probabilities of the answer token (the next token after the prompt). `coded`: codec
    name -> an engine on the same model over a disk tier that stores blocks with that codec. `targets`: blend
    with these quality targets; `recomputed` (when given) receives, per such mode, the chunk tokens it recomputed.
    `ape`: APE rows, modular's and (`ape_blends`, default every blend) blend's."""
    ape_blends = (blends if ape_blends is None else ape_blends) if ape else ()
    from pc_rag.options import GenerationOptions
    from pc_rag.request import prefill

    prompt = example.prompt()
    out = {}
    for codec, other in (coded or {}).items():
        other.warm(list(example.chunks), progress=False)  # stored compressed, then read back by the request
        out[f"modular {codec}"] = torch.log_softmax(other.next_token_logits(prompt, mode="modular").float(), -1)

    def logp(mode, ratio=0.0, align=None):
        return torch.log_softmax(engine.next_token_logits(prompt, mode=mode, recompute_ratio=ratio,
                                                          align=align).float(), -1)

    out["full"] = logp("full")
    out["modular"] = logp("modular")
    if ape:
        out["modular ape"] = logp("modular", align="ape")
    if sweep:
        from pc_rag.align import APE

        chosen = engine.ape
        try:
            for spec in sweep:
                engine.ape = APE(*parse_pair(spec))
                out[sweep_name(spec)] = logp("modular", align="ape")
        finally:
            engine.ape = chosen
    selection = engine.blend_selection
    try:
        for spec in blends:
            ratio, engine.blend_selection = parse_blend(spec)
            out[blend_name(spec)] = logp("blend", ratio)
            if spec in ape_blends:
                out[blend_name(spec) + " ape"] = logp("blend", ratio, "ape")
    finally:
        engine.blend_selection = selection
    for spec in targets:
        target, select = parse_auto(spec)
        try:
            engine.blend_selection = select
            with engine.traffic.counted():
                options = GenerationOptions(mode="blend", recompute_ratio=0.0, recompute_target=target)
                asm = prefill(engine, prompt, options)
                engine.runner.release_cache(asm.cache)
        finally:
            engine.blend_selection = selection
        out[auto_name(spec)] = torch.log_softmax(asm.logits.float(), -1)
        if recomputed is not None:
            recomputed[auto_name(spec)] = asm.recomputed_tokens
    engine.add_scaffold(list(example.chunks))
    engine.next_token_logits(prompt, mode="modular")  # the first use encodes the group
    engine.wait_for_background()
    out["scaffold"] = logp("modular")
    engine.planner.scaffolds.clear()
    # exact last: its prefix (everything but the question) would otherwise serve the modes above too.
    engine.next_token_logits(prompt, mode="exact")
    out["exact"] = logp("exact")
    return out


def greedy(tokenizer, logps: dict[str, torch.Tensor]) -> dict[str, str]:
    """Per mode, the greedy answer (what generate(max_new_tokens=1) returns)."""
    return {m: tokenizer.decode([int(lp.argmax())]).strip() for m, lp in logps.items()}


def answers(engine, example, blends: list[str]) -> dict[str, str]:
    return greedy(engine.tokenizer, answer_logprobs(engine, example, blends))


def parse_pair(spec: str) -> tuple[float, float]:
    t, _, scale = spec.partition(":")
    try:
        return float(t), float(scale)
    except ValueError:
        raise SystemExit(f"--ape-sweep {spec!r}: expected T:S") from None


def sweep_name(spec: str) -> str:
    t, scale = parse_pair(spec)
    return f"ape {t:g} {scale:g}"


APE_SEED = 31337  # the calibration prompts' stream: neither training's (0, 99, 10000 + seed) nor the rows' (777, 2026)


def example(rng: random.Random, task: str, k: int, lengths: tuple[int, int] | None):
    """A held-out prompt of the testbed: one-sentence chunks, or (`lengths`, the long-chunk testbed's) each fact in
    prose."""
    ex = make_example(rng, task, k, names(), values())
    return in_prose(rng, ex, *lengths) if lengths else ex


def calibrate_ape(engine, prompts: int, chunk_counts: list[int], tasks: tuple[str, ...], seed: int,
                  lengths: tuple[int, int] | None = None) -> dict:
    """APE's pair for the model, chosen on `prompts` examples spread over the tasks and chunk counts (a stream of
    its own), and what every pair of the grid measured there."""
    rng = random.Random(seed)
    cases = [(t, k) for t in tasks for k in chunk_counts]
    examples = [example(rng, *cases[i % len(cases)], lengths).prompt() for i in range(prompts)]
    t0 = time.time()
    ape, table = engine.calibrate_ape(examples)
    return {"temperature": ape.temperature, "scale": ape.scale, "prompts": prompts, "seed": seed,
            "seconds": round(time.time() - t0, 1),
            "grid": [{"temperature": t, "scale": s, **m} for (t, s), m in table.items()]}


def run(model: str, prompts: int, chunk_counts: list[int], seed: int, blends: list[str],
        codecs: list[str] = (), tasks: tuple[str, ...] = TASKS, targets: list[float | str] = (),
        ape: str | tuple[float, float] | None = None, ape_calibration: int = 64, ape_seed: int = APE_SEED,
        sweep: list[str] = (), ape_blends: list[str] | None = None) -> dict:
    """`ape`: None (no APE rows), "calibrate" (calibrated on `ape_calibration` prompts of stream `ape_seed`), or
    a (temperature, scale) pair; `ape_blends`: the blends also run with APE (default: every one)."""
    engine = pc_rag.Engine.from_pretrained(model, store="memory")
    lengths = chunk_tokens_of(model)
    calibration = None
    if ape == "calibrate":
        calibration = calibrate_ape(engine, ape_calibration, chunk_counts, tasks, ape_seed, lengths)
        print(json.dumps({k: v for k, v in calibration.items() if k != "grid"}), flush=True)
    elif ape is not None:
        from pc_rag.align import APE

        engine.ape = APE(*ape)
        calibration = {"temperature": ape[0], "scale": ape[1], "prompts": 0}
    with_ape = ape is not None
    ape_blends = (list(blends) if ape_blends is None else list(ape_blends)) if with_ape else []
    # A disk tier alone: a block is written compressed and every later request reads it back from there.
    folder = Path(tempfile.mkdtemp(prefix="pc_rag_accuracy_"))
    coded = {c: pc_rag.Engine(engine.model, engine.tokenizer, store=f"disk:{folder / c}?compress={c}") for c in codecs}
    modes = [*BASE_MODES[:3], *(f"modular {c}" for c in codecs), *(["modular ape"] if with_ape else []),
             *(blend_name(b) for b in blends), *(blend_name(b) + " ape" for b in ape_blends),
             *(auto_name(t) for t in targets), *(sweep_name(p) for p in sweep), BASE_MODES[3]]
    layers = engine.runner.shape.num_layers
    rng = random.Random(seed)
    rows = []
    for task in tasks:
        for k in chunk_counts:
            right = dict.fromkeys(modes, 0)
            agree = dict.fromkeys(modes, 0)
            kls = dict.fromkeys(modes, 0.0)
            # token-layers of reused chunk tokens computed in context, as a share of a full recompute: full 1,
            # nothing reused; exact, modular, its codecs and scaffold 0, they recompute nothing at the request
            work = {"full": 1.0, "exact": 0.0, "modular": 0.0, "scaffold": 0.0, **{f"modular {c}": 0.0 for c in codecs},
                    **{blend_name(b): 0.0 for b in blends}, **{auto_name(t): 0.0 for t in targets},
                    **({"modular ape": 0.0} if with_ape else {}), **{sweep_name(p): 0.0 for p in sweep},
                    **{blend_name(b) + " ape": 0.0 for b in ape_blends}}
            t0 = time.time()
            for _ in range(prompts):
                ex = example(rng, task, k, lengths)
                ids = [i for s in engine.segmenter.segments(ex.prompt()) for i in s.token_ids]
                assert ids == token_ids(engine.tokenizer, ex), "engine tokenization differs from training"
                recomputed = {}
                logps = answer_logprobs(engine, ex, blends, coded, targets, recomputed, with_ape, sweep, ape_blends)
                chunk_tokens = sum(len(engine.segmenter.ids(c)) for c in ex.chunks)
                for b in blends:
                    ratio, select = parse_blend(b)
                    share = recompute_work(select, ratio, chunk_tokens, layers,
                                           engine.runner.shift_probe_share(len(ids))) / prompts
                    work[blend_name(b)] += share
                    if b in ape_blends:  # APE adds no recompute
                        work[blend_name(b) + " ape"] += share
                for name, chosen in recomputed.items():  # the probe, then the tokens it chose, narrowed as progressive
                    if name.endswith("shift"):  # the cheap probe over every candidate, then layer 0 over 3x its pick
                        work[name] += recompute_work("shift", chosen / chunk_tokens, chunk_tokens, layers,
                                                     engine.runner.shift_probe_share(len(ids)), target=True) / prompts
                    else:
                        work[name] += recompute_work("progressive", chosen / chunk_tokens, chunk_tokens,
                                                     layers) / prompts
                got = greedy(engine.tokenizer, logps)
                for m in modes:
                    right[m] += got[m] == ex.answer
                    agree[m] += got[m] == got["full"]
                    kls[m] += kl(logps["full"], logps[m]) / prompts  # log_softmax of log-probs is a no-op
            rows.append({"task": task, "chunks": k, "prompts": prompts,
                         "accuracy": {m: right[m] / prompts for m in modes},
                         "agreement_with_full": {m: agree[m] / prompts for m in modes},
                         "mean_kl_from_full": kls,
                         "work": work,
                         "seconds": round(time.time() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    out = {"model": str(model), "seed": seed, "modes": modes, "rows": rows}
    if calibration is not None:
        out["ape"] = calibration
    return out


def pool(results: list[dict]) -> dict:
    """Runs of the same modes on several seeds as one: per (task, chunks), rates and means weighted by prompts."""
    first = results[0]
    rows = []
    for r0 in first["rows"]:
        same = [r for res in results for r in res["rows"] if (r["task"], r["chunks"]) == (r0["task"], r0["chunks"])]
        n = sum(r["prompts"] for r in same)
        row = {"task": r0["task"], "chunks": r0["chunks"], "prompts": n}
        for field in ("accuracy", "agreement_with_full", "mean_kl_from_full", "work"):
            row[field] = {m: sum(r[field][m] * r["prompts"] for r in same) / n for m in r0.get(field, {})}
        rows.append(row)
    return {"model": first["model"], "seed": [res["seed"] for res in results], "modes": first["modes"], "rows": rows}


def recovered(row: dict, mode: str) -> float | None:
    """The share of modular's loss that `mode` recovers in `row`: (mode - modular) / (full - modular)."""
    acc = row["accuracy"]
    loss = acc["full"] - acc["modular"]
    return (acc[mode] - acc["modular"]) / loss if loss > 0 else None


def markdown(result: dict) -> str:
    modes = result["modes"]
    lines = [
        f"Answer accuracy per mode (greedy first token), model `{result['model']}`; in brackets: agreement with "
        "full.",
        "",
        "| task | chunks | N | " + " | ".join(modes) + " |",
        "|---|---|---|" + "---|" * len(modes),
    ]
    for r in result["rows"]:
        cells = []
        for m in modes:
            acc = f"{100 * r['accuracy'][m]:.1f}%"
            cells.append(acc if m == "full" else f"{acc} ({100 * r['agreement_with_full'][m]:.0f}%)")
        lines.append(f"| {TASK_TITLES[r['task']]} | {r['chunks']} | {r['prompts']} | " + " | ".join(cells) + " |")
    blends = [m for m in modes if m.startswith(("blend", "auto", "ape ")) or m == "modular ape"]
    lines += [
        "",
        "Share of modular's loss recovered, (mode - modular) / (full - modular), and for blends the compute: "
        "token-layers of the chunk tokens computed in context, as a share of a full recompute:",
        "",
        "| task | chunks | " + " | ".join([*blends, "scaffold"]) + " |",
        "|---|---|" + "---|" * (len(blends) + 1),
    ]
    for r in result["rows"]:
        cells = [(f"{100 * recovered(r, m):.0f}%" if recovered(r, m) is not None else "–")
                 + (f" ({r['work'][m]:.2f})" if m in r.get("work", {}) else "") for m in [*blends, "scaffold"]]
        lines.append(f"| {TASK_TITLES[r['task']]} | {r['chunks']} | " + " | ".join(cells) + " |")
    compared = [m for m in modes if m != "full"]
    lines += [
        "",
        "Mean KL(full ‖ mode) of the answer-token distribution, in nats (0 = the same distribution as full):",
        "",
        "| task | chunks | " + " | ".join(compared) + " |",
        "|---|---|" + "---|" * len(compared),
    ]
    for r in result["rows"]:
        cells = [f"{r['mean_kl_from_full'][m]:.2e}" for m in compared]
        lines.append(f"| {TASK_TITLES[r['task']]} | {r['chunks']} | " + " | ".join(cells) + " |")
    ape = result.get("ape")
    if ape is not None:
        lines += ["", f"APE (`align=\"ape\"`): temperature {ape['temperature']:g}, scale {ape['scale']:g}"
                  + (f", calibrated on {ape['prompts']} prompts (seed {ape['seed']}) by mean KL(full ‖ APE) of the "
                     "next token" if ape.get("prompts") else ", given")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/retrieval-model")
    ap.add_argument("--prompts", type=int, default=200, help="held-out prompts per task and chunk count")
    ap.add_argument("--chunks", type=int, nargs="+", default=[4])
    ap.add_argument("--blend", nargs="*", default=list(DEFAULT_BLENDS), help="RATIO:SELECTION settings to compare")
    ap.add_argument("--auto", nargs="*", default=list(DEFAULT_TARGETS),
                    help="quality targets: blend with recompute_target T, rows named 'auto T' (T:shift: the target "
                         "read from the cheap probe, rows 'auto T shift')")
    ap.add_argument("--codec", nargs="*", default=[], choices=["int8"],
                    help="also modular with chunk blocks stored with this codec (read back from a disk tier)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(ALL_TASKS),
                    help="alias: a chunk naming an entity only an earlier chunk defines (a model trained on it: "
                         "benchmarks/deep-retrieval-model)")
    ap.add_argument("--ape", action="store_true",
                    help="also modular and every blend with align='ape', T and S calibrated first (or --ape-pair)")
    ap.add_argument("--ape-pair", type=float, nargs=2, metavar=("T", "S"), help="APE's pair, not calibrated")
    ap.add_argument("--ape-sweep", nargs="*", default=[], metavar="T:S",
                    help="also modular with APE at each of these pairs (rows 'ape T S')")
    ap.add_argument("--ape-blend", nargs="*", default=None, metavar="RATIO:SELECTION",
                    help="with --ape: the --blend settings also run with APE (default: every one)")
    ap.add_argument("--ape-calibration", type=int, default=64, help="prompts APE is calibrated on")
    ap.add_argument("--ape-seed", type=int, default=APE_SEED, help="the calibration prompts' stream")
    ap.add_argument("--seed", type=int, default=777)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for spec in args.blend:
        parse_blend(spec)
    for spec in args.auto:
        parse_auto(spec)
    for spec in args.ape_sweep:
        parse_pair(spec)
    if args.ape_blend is not None and not set(args.ape_blend) <= set(args.blend):
        raise SystemExit(f"--ape-blend {' '.join(args.ape_blend)}: each must be one of --blend's settings")
    ape = tuple(args.ape_pair) if args.ape_pair else "calibrate" if args.ape else None
    result = run(args.model, args.prompts, args.chunks, args.seed, args.blend, args.codec, tuple(args.tasks),
                 args.auto, ape, args.ape_calibration, args.ape_seed, args.ape_sweep, args.ape_blend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"accuracy-seed{args.seed}.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / f"accuracy-seed{args.seed}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
