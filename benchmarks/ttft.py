"""TTFT side by side, in one process on the same prompts: HF baselines, pc_rag modes, and the ideal.

    python -m benchmarks.ttft --lengths 1024 2048 4096 8192 --reps 5 --out bench_out

Workload: a system text, k chunks of real text (pydoc topics, ~256 tokens each) and a short question.
- hf_full: plain `model(...)` over the whole prompt.
- hf_prefix: HF's documented prefix reuse: the system text prefilled once, `copy.deepcopy` of that cache
  per request, then the rest of the prompt.
- pc_full / pc_exact (the same chunk sequence repeated) / pc_modular (chunks warmed on their own and
  then assembled in an order no request used), warm from memory and from disk (memory tier emptied before
  each request), and cold (empty store: every chunk encoded on the request path); pc_blend at several
  recompute ratios with the deviation selection, and with chunk-start (first tokens of each chunk).
- pc_modular / pc_exact warm from Redis: a second engine on the same model over memory and a local
  redis-server (started on a free port when `redis-server` is installed, or --redis URL) holding a copy of
  the disk tier's blocks; the memory tier emptied before each request.
- ideal: only the question, over a cache that already holds the rest (the floor no cache can beat).
Also: decode tokens/s (pc_rag vs HF over the same cache, 32 tokens, and --decode-tokens (512) against HF
`generate` over the same cache), chunk warm-up throughput vs full prefill throughput, disk load GB/s, bytes
per stored token vs 2*L*H_kv*d_h*b, and where a request from disk or Redis spends its time (`load_steps`:
lookups, of which the tier's open/read/verify sums, relocation and copy into the request buffer, forward).
Writes ttft.json, ttft.md and ttft.png under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

import pc_rag
from pc_rag.lookups import StoreLookups

from .common import (
    build_prompt,
    emptied,
    interleaved,
    load_steps,
    local_redis,
    model_or_bench,
    release_freed_memory,
    timeit,
    workloads,
)

BLEND_RATIOS = (0.05, 0.15, 0.3)  # deviation selection
CHUNK_START_RATIOS = (0.15, 0.3)
def run(model_path, lengths, reps, dtype="float32", device="cpu", seed=0, redis="auto", decode_tokens=512):
    disk_dir = Path(tempfile.mkdtemp(prefix="pc_rag_bench_disk_"))
    try:
        with local_redis(redis) as redis_url:
            return _run(model_path, lengths, reps, dtype, device, seed, disk_dir, redis_url, decode_tokens)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)  # the disk tier holds every chunk's KV: gigabytes at 8K


def run_exact_disk(model_path, lengths, reps, dtype="float32", device="cpu", seed=0):
    """Issue #12's goal alone (`--exact-disk`): exact mode warm from disk (memory tier emptied before each
    request, its memory handed back to the OS) against the ideal and exact warm from memory, measured in turn,
    then the disk request's steps; disk blocks read straight into the request buffer (the default) and, for
    comparison, each into memory of its own (`StoreLookups(direct=False)`, the path before direct loads).
    TTFT is the engine's `ttft_s` of a one-token generate; in the steps, `save_ms` is what follows the logits
    (storing and promoting blocks), not in TTFT. Same prompts as `run` for the same seed."""
    disk_dir = Path(tempfile.mkdtemp(prefix="pc_rag_bench_disk_"))
    try:
        engine = pc_rag.Engine.from_pretrained(model_path, dtype=dtype, device=device,
                                               store=["memory:16GiB", f"disk:{disk_dir}?max_bytes=64GiB"])
        memory_tier, disk_tier = engine.store.tiers
        rows = []
        for w in workloads(engine, lengths, seed):
            engine.store.clear()
            engine.generate(w.prompt, mode="exact", max_new_tokens=1)

            def exact(prompt=w.prompt):
                return engine.generate(prompt, mode="exact", max_new_tokens=1)

            def reading(direct):  # setup: empty memory; disk blocks read into the request buffer, or into their own
                def setup():
                    emptied(engine, memory_tier)()
                    release_freed_memory()  # as in a new process: blocks read next get fresh pages
                    # read straight into the request buffer, or each block into memory of its own first
                    engine.assembler.lookups = lambda: StoreLookups(engine.store, engine.assembler.place, direct)
                return setup

            row = {"prompt_tokens": len(w.ids)}
            row |= interleaved({"ideal": w.ideal_case(), "pc_exact_warm_memory": (exact, exact),
                                "pc_exact_warm_disk": (exact, reading(True)),
                                "pc_exact_warm_disk_own_memory": (exact, reading(False))}, reps)
            del engine.assembler.lookups  # the engine's own again
            for key in ("pc_exact_warm_disk", "pc_exact_warm_disk_own_memory", "pc_exact_warm_memory"):
                row[key.removeprefix("pc_").replace("_warm", "") + "_over_ideal"] = (
                    row[key]["median_s"] / row["ideal"]["median_s"])
            row["load_steps"] = {}
            for name, direct in (("exact_disk", True), ("exact_disk_own_memory", False)):
                steps = load_steps(engine, disk_tier, lambda p=w.prompt: engine.next_token_logits(p, mode="exact"),
                                   reps, reading(direct))
                row["load_steps"][name] = steps
            vars(engine.assembler).pop("lookups", None)
            rows.append(row)
            print(_row_line(row), flush=True)
        return {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "rows": rows}
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)


def mirror_to(source, target) -> int:
    """Copies every block of the DiskStore `source` into `target` (another tier); returns how many."""
    n = 0
    for key in list(source._index):
        block = source.get(key)
        if block is not None:
            target.put(key, block)
            n += 1
    return n


def _run(model_path, lengths, reps, dtype, device, seed, disk_dir, redis_url=None, decode_tokens=512):
    engine = pc_rag.Engine.from_pretrained(model_path, dtype=dtype, device=device,
                                           store=["memory:16GiB", f"disk:{disk_dir}?max_bytes=64GiB"])
    memory_tier, disk_tier = engine.store.tiers
    redis_engine = None
    if redis_url is not None:
        redis_engine = pc_rag.Engine(engine.model, engine.tokenizer, store=["memory:16GiB", redis_url])
        redis_memory, redis_tier = redis_engine.store.tiers
    rows = []
    for w in workloads(engine, lengths, seed):

        # A one-token generate: its ttft_s is the time to the first token, without what the engine does after
        # the reply (storing new prefix blocks, promoting blocks read from disk into memory).
        def pc(mode, prompt=w.prompt, ratio=0.15):
            return lambda: engine.generate(prompt, mode=mode, max_new_tokens=1, recompute_ratio=ratio)

        engine.store.clear()
        t0 = time.perf_counter()
        engine.warm(w.chunks, progress=False)
        warm_s = time.perf_counter() - t0
        chunk_tokens = sum(len(engine.segmenter.ids(c)) for c in w.chunks)
        engine.generate(build_prompt(w.chunks[::-1]), mode="modular", max_new_tokens=1)  # system text node
        row = {"prompt_tokens": len(w.ids), "chunks": len(w.chunks), "question_tokens": w.q}
        row["hf_full"] = timeit(w.hf_full, reps)
        row["hf_prefix"] = timeit(w.hf_prefix, reps)
        row["pc_full"] = timeit(pc("full"), reps)
        engine.blend_selection = "deviation"
        for ratio in BLEND_RATIOS:
            row[f"pc_blend_{ratio}"] = timeit(pc("blend", ratio=ratio), reps)
        engine.blend_selection = "chunk_start"
        for ratio in CHUNK_START_RATIOS:
            row[f"pc_blend_{ratio}_chunk_start"] = timeit(pc("blend", ratio=ratio), reps)
        engine.generate(w.prompt, mode="exact", max_new_tokens=1)
        # The ideal and the warm columns whose ratios are the goals, measured in turn (see `interleaved`).
        # A memory case's setup is one untimed run of it: the case before it may have emptied the memory tier.
        cases = {"ideal": w.ideal_case(),
                 "pc_modular_warm_memory": (pc("modular"), pc("modular")),
                 "pc_modular_warm_disk": (pc("modular"), emptied(engine, memory_tier)),
                 "pc_exact_warm_memory": (pc("exact"), pc("exact")),
                 "pc_exact_warm_disk": (pc("exact"), emptied(engine, memory_tier))}
        if redis_engine is not None:
            redis_tier.clear()
            mirror_to(disk_tier, redis_tier)  # the same blocks, one tier further

            def pr(mode, prompt=w.prompt):
                return lambda: redis_engine.generate(prompt, mode=mode, max_new_tokens=1)

            cases["pc_modular_warm_redis"] = (pr("modular"), emptied(redis_engine, redis_memory))
            cases["pc_exact_warm_redis"] = (pr("exact"), emptied(redis_engine, redis_memory))
        row |= interleaved(cases, reps)
        def logits(e, mode, prompt=w.prompt):  # load steps time the request up to its logits, nothing after
            return lambda: e.next_token_logits(prompt, mode=mode)

        cold = emptied(engine, memory_tier)
        steps = {"modular_disk": load_steps(engine, disk_tier, logits(engine, "modular"), reps, cold),
                 "exact_disk": load_steps(engine, disk_tier, logits(engine, "exact"), reps, cold)}
        if redis_engine is not None:
            steps["modular_redis"] = load_steps(redis_engine, redis_tier, logits(redis_engine, "modular"), reps,
                                                emptied(redis_engine, redis_memory))
            redis_tier.clear()
            redis_memory.clear()
        row["load_steps"] = steps
        row["pc_modular_cold"] = timeit(pc("modular"), max(1, reps // 2), setup=engine.store.clear)

        for mode in ("full", "exact", "modular"):  # reuse only changes the prefill: these must agree
            gen = engine.generate(w.prompt, mode=mode, max_new_tokens=33)
            row[f"pc_{mode}_decode_tokens_per_s"] = gen.decode_tokens_per_s
        row["hf_decode_tokens_per_s"] = w.hf_decode_tokens_per_s(32)
        if decode_tokens:
            # The same greedy loop over n tokens: pc_rag's stream (modular, incremental detokenization) against
            # HF generate over the same cache. An EOS may end pc_rag's reply early: its token count is kept.
            gen = engine.generate(w.prompt, mode="modular", max_new_tokens=decode_tokens)
            row["pc_decode_long"] = {"tokens": len(gen.token_ids), "tokens_per_s": gen.decode_tokens_per_s}
            row["hf_generate_long"] = {"tokens": decode_tokens,
                                       "tokens_per_s": w.hf_generate_tokens_per_s(decode_tokens)}
        row["warm_tokens_per_s"] = chunk_tokens / warm_s
        row["full_prefill_tokens_per_s"] = len(w.ids) / row["hf_full"]["median_s"]
        row["disk_load_GBps"] = _disk_load_gbps(engine, memory_tier, w.chunks)
        row["speedup_modular_vs_hf_full"] = row["hf_full"]["median_s"] / row["pc_modular_warm_memory"]["median_s"]
        row["modular_over_ideal"] = row["pc_modular_warm_memory"]["median_s"] / row["ideal"]["median_s"]
        row["exact_over_ideal"] = row["pc_exact_warm_memory"]["median_s"] / row["ideal"]["median_s"]
        for key in ("pc_modular_warm_disk", "pc_exact_warm_disk", "pc_modular_warm_redis", "pc_exact_warm_redis"):
            if key in row:
                row[key.removeprefix("pc_").replace("_warm", "") + "_over_ideal"] = (
                    row[key]["median_s"] / row["ideal"]["median_s"])
        rows.append(row)
        print(_row_line(row), flush=True)
    shape = engine.runner.shape
    block = engine.assembler.encode_chunk(tuple(range(10, 74)), 1)
    return {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.platform()}",
        "model": str(model_path), "dtype": dtype, "device": device,
        "params": sum(p.numel() for p in engine.model.parameters()),
        "shape": {"layers": shape.num_layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim},
        "bytes_per_token_stored": block.nbytes / block.num_tokens,
        "bytes_per_token_formula": shape.kv_bytes_per_token(engine.runner.dtype),
        "date": time.strftime("%Y-%m-%d"), "reps": reps, "rows": rows,
    }


def _disk_load_gbps(engine, memory_tier, chunks):
    from pc_rag.blocks import chunk_key

    sink = engine.planner.sink_ids
    keys = [chunk_key(engine.runner.fingerprint, engine.segmenter.ids(c), sink, len(sink)) for c in chunks]
    disk = engine.store.tiers[1]
    memory_tier.clear()
    t0 = time.perf_counter()
    nbytes = sum(b.nbytes for b in disk.get_many(keys))  # one request's batch: read in parallel
    return nbytes / (time.perf_counter() - t0) / 1e9


def _row_line(row):
    ms = {k: round(v["median_s"] * 1000, 1) for k, v in row.items() if isinstance(v, dict) and "median_s" in v}
    rest = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
            if not (isinstance(v, dict) and "median_s" in v)}
    return json.dumps(rest | {"median_ms": ms})


COLUMNS = [("hf_full", "HF full prefill"), ("hf_prefix", "HF prefix reuse (deepcopy)"),
           ("pc_full", "pc_rag full"), ("pc_exact_warm_memory", "exact warm (memory)"),
           ("pc_exact_warm_disk", "exact warm (disk)"),
           ("pc_exact_warm_redis", "exact warm (Redis)"),
           ("pc_modular_cold", "modular cold"), ("pc_modular_warm_memory", "modular warm (memory)"),
           ("pc_modular_warm_disk", "modular warm (disk)"), ("pc_modular_warm_redis", "modular warm (Redis)"),
           *[(f"pc_blend_{r}", f"blend {r} deviation") for r in BLEND_RATIOS],
           *[(f"pc_blend_{r}_chunk_start", f"blend {r} chunk-start") for r in CHUNK_START_RATIOS],
           ("ideal", "ideal")]


def markdown(result):
    lines = [
        f"Model: {result['model']} ({result['params'] / 1e6:.1f}M parameters, {result['dtype']}, {result['device']}); "
        f"machine: {result['machine']}; {result['date']}; median of {result['reps']} runs, milliseconds.",
        "",
        "| prompt tokens | " + " | ".join(name for _, name in COLUMNS)
        + " | modular speedup vs HF full | modular / ideal |",
        "|---" * (len(COLUMNS) + 3) + "|",
    ]
    for r in result["rows"]:
        cells = [f"{r[k]['median_s'] * 1000:.1f}" if k in r else "–" for k, _ in COLUMNS]
        lines.append(f"| {r['prompt_tokens']} | " + " | ".join(cells)
                     + f" | {r['speedup_modular_vs_hf_full']:.1f}x | {r['modular_over_ideal']:.2f} |")
    lines += ["", "| prompt tokens | decode tok/s full | decode tok/s exact | decode tok/s modular | decode tok/s HF "
              "| chunk warm-up tok/s | full prefill tok/s | disk load GB/s |", "|---" * 8 + "|"]
    for r in result["rows"]:
        decode = " | ".join(f"{r[f'pc_{m}_decode_tokens_per_s']:.1f}" for m in ("full", "exact", "modular"))
        lines.append(f"| {r['prompt_tokens']} | {decode} | {r['hf_decode_tokens_per_s']:.1f} "
                     f"| {r['warm_tokens_per_s']:.0f} | {r['full_prefill_tokens_per_s']:.0f} "
                     f"| {r['disk_load_GBps']:.2f} |")
    ratios = [("modular_disk_over_ideal", "modular disk"), ("exact_disk_over_ideal", "exact disk"),
              ("modular_redis_over_ideal", "modular Redis"), ("exact_redis_over_ideal", "exact Redis")]
    lines += ["", "Warm from a persistent tier, against the ideal (the memory tier emptied before each request):", "",
              "| prompt tokens | " + " | ".join(f"{name} / ideal" for _, name in ratios) + " |", "|---" * 5 + "|"]
    for r in result["rows"]:
        lines.append(f"| {r['prompt_tokens']} | " + " | ".join(f"{r[k]:.2f}" if k in r else "–" for k, _ in ratios)
                     + " |")
    lines += ["", "Where a request from a persistent tier spends its time (median ms per request; open, read, verify "
              "and decode are sums over blocks read in parallel, so they can exceed the tier's wall time `load`; "
              "direct = blocks read from disk or Redis straight into the request buffer, relocated keys then rotated "
              "there (the tier's wall time `load` and the rotation); copy = relocating keys and copying values of the "
              "other blocks into the request buffer; what follows the reply (storing, promoting) is left out):", "",
              "| prompt tokens | path | TTFT | plan (lookups) | direct | tier wall | open | read | verify | decode "
              "| copy | forward | MB read | GB/s (read / tier wall) |", "|---" * 14 + "|"]
    for r in result["rows"]:
        for path, st in r.get("load_steps", {}).items():
            gbps = st["bytes_read"] / (st["load_ms"] / 1000) / 1e9 if st["load_ms"] else float("nan")
            cells = [st[k] for k in ("ttft_ms", "plan_ms", "direct_ms", "load_ms", "open_ms", "read_ms", "verify_ms",
                                     "decode_ms", "copy_ms", "forward_ms")]
            lines.append(f"| {r['prompt_tokens']} | {path.replace('_', ' ')} | "
                         + " | ".join(f"{c:.1f}" for c in cells) + f" | {st['bytes_read'] / 1e6:.1f} | {gbps:.2f} |")
    if any("pc_decode_long" in r for r in result["rows"]):
        lines += ["", "| prompt tokens | decode tok/s pc_rag (modular, tokens) | decode tok/s HF generate (tokens) |",
                  "|---|---|---|"]
        for r in result["rows"]:
            if "pc_decode_long" in r:
                p, h = r["pc_decode_long"], r["hf_generate_long"]
                lines.append(f"| {r['prompt_tokens']} | {p['tokens_per_s']:.1f} ({p['tokens']}) "
                             f"| {h['tokens_per_s']:.1f} ({h['tokens']}) |")
    lines += ["", f"Bytes per stored token: {result['bytes_per_token_stored']:.0f} "
              f"(formula 2·L·H_kv·d_h·b = {result['bytes_per_token_formula']})."]
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["prompt_tokens"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors
    for i, (key, name) in enumerate(COLUMNS):
        if any(key not in r for r in result["rows"]):
            continue
        style = "--" if key.startswith("hf") or key == "ideal" else "-"
        ax.plot(xs, [r[key]["median_s"] * 1000 for r in result["rows"]], style, marker="osD^v"[i % 5],
                color=colors[(2 * i) % 20 + (i >= 10)], label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms, median)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT, {result['params'] / 1e6:.0f}M-parameter Llama shape, {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the offline 'bench' Llama under --out)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--redis", default="auto", help="Redis URL for the Redis columns; 'auto' (default) starts a "
                    "local redis-server when installed; 'none' skips them")
    ap.add_argument("--decode-tokens", type=int, default=512, help="long decode against HF generate (0: skip)")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--exact-disk", action="store_true", help="only exact warm from disk against the ideal, with "
                    "its step breakdown (issue #12); prints JSON lines, writes nothing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = model_or_bench(args.model, out)
    if args.exact_disk:
        run_exact_disk(model, args.lengths, args.reps, args.dtype, args.device)
        return
    result = run(model, args.lengths, args.reps, args.dtype, args.device, redis=args.redis,
                 decode_tokens=args.decode_tokens)
    (out / "ttft.json").write_text(json.dumps(result, indent=2))
    (out / "ttft.md").write_text(markdown(result))
    plot(result, out / "ttft.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
