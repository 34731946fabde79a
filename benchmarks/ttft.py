"""TTFT side by side, in one process on the same prompts: HF baselines, pc_rag modes, and the ideal.

    python benchmarks/ttft.py --lengths 1024 2048 4096 8192 --reps 5 --out bench_out

Workload: a system text, k chunks of real text (pydoc topics, ~256 tokens each) and a short question.
- hf_full: plain `model(...)` over the whole prompt.
- hf_prefix: HF's documented prefix reuse: the system text prefilled once, `copy.deepcopy` of that cache
  per request, then the rest of the prompt.
- pc_full / pc_exact (the same chunk sequence repeated) / pc_modular (chunks warmed on their own and
  then assembled in an order no request used), warm from memory and from disk (memory tier emptied before
  each request), and cold (empty store: every chunk encoded on the request path); pc_blend at several
  recompute ratios with the deviation selection, and with chunk-start (first tokens of each chunk).
- ideal: only the question, over a cache that already holds the rest (the floor no cache can beat).
Also: decode tokens/s (pc_rag vs HF over the same cache), chunk warm-up throughput vs full prefill
throughput, disk load GB/s, bytes per stored token vs 2*L*H_kv*d_h*b.
Writes ttft.json, ttft.md and ttft.png under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import pc_rag
from pc_rag import Chunk, Text

BLEND_RATIOS = (0.05, 0.15, 0.3)  # deviation selection
CHUNK_START_RATIOS = (0.15, 0.3)
SYSTEM = "You are a helpful assistant. Answer the question using only the documents below.\n\n"
QUESTION = "\n\nQuestion: Which statement does the documentation above describe, and how is it used?\nAnswer:"


def corpus_chunks(engine, tokens_per_chunk=256):
    """Real text cut into chunks of about `tokens_per_chunk` tokens."""
    chunks = []
    for text in pc_rag.testing.pydoc_corpus():
        ids = engine.segmenter.ids(text)
        for i in range(0, len(ids) - tokens_per_chunk, tokens_per_chunk):
            chunks.append(engine.tokenizer.decode(ids[i: i + tokens_per_chunk]))
    return chunks


def build_prompt(chunks):
    parts = [Text(SYSTEM)]
    for c in chunks:
        parts += [Chunk(c), Text("\n\n")]
    return parts[:-1] + [Text(QUESTION)]


def timeit(fn, reps, setup=None):
    """min and median seconds of `fn` over `reps` runs after one warm-up; `setup` runs untimed before each."""
    times = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return {"min_s": min(times), "median_s": statistics.median(times)}


class Workload:
    """One prompt and its HF-side references."""

    def __init__(self, engine, chunks):
        self.engine, self.chunks = engine, chunks
        self.prompt = build_prompt(chunks)
        segs = engine.segmenter.segments(self.prompt)
        self.ids = [t for s in segs for t in s.token_ids]
        self.q = len(segs[-1])
        self.n_sys = len(segs[0]) + len(segs[1])
        self.x = torch.tensor([self.ids], device=engine.runner.device)
        model = engine.model
        with torch.inference_mode():
            self.sys_cache = DynamicCache(config=model.config)
            model(input_ids=self.x[:, : self.n_sys], cache=self.sys_cache)
            pre = DynamicCache(config=model.config)
            model(input_ids=self.x[:, : -self.q], cache=pre)
        self.prefix_kv = [(layer.keys, layer.values) for layer in pre.layers]

    @torch.inference_mode()
    def hf_full(self):
        self.engine.model(input_ids=self.x, logits_to_keep=1)

    @torch.inference_mode()
    def hf_prefix(self):
        cache = copy.deepcopy(self.sys_cache)
        self.engine.model(input_ids=self.x[:, self.n_sys:], cache=cache, logits_to_keep=1)

    def ideal(self, reps):
        """The question alone over a ready DynamicCache (the cache copy is made outside the timing)."""
        caches = []

        def setup():
            caches[:] = [DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in self.prefix_kv])]

        @torch.inference_mode()
        def run():
            self.engine.model(input_ids=self.x[:, -self.q:], cache=caches[0], logits_to_keep=1)

        return timeit(run, reps, setup)

    @torch.inference_mode()
    def hf_decode_tokens_per_s(self, n=32):
        """Greedy decode with HF's DynamicCache over the full prompt cache."""
        cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in self.prefix_kv])
        out = self.engine.model(input_ids=self.x[:, -self.q:], cache=cache, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = self.engine.model(input_ids=tok, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        return n / (time.perf_counter() - t0)


def run(model_path, lengths, reps, dtype="float32", device="cpu", seed=0):
    disk_dir = Path(tempfile.mkdtemp(prefix="pc_rag_bench_disk_"))
    try:
        return _run(model_path, lengths, reps, dtype, device, seed, disk_dir)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)  # the disk tier holds every chunk's KV: gigabytes at 8K


def _run(model_path, lengths, reps, dtype, device, seed, disk_dir):
    engine = pc_rag.Engine.from_pretrained(model_path, dtype=dtype, device=device,
                                           store=["memory:16GiB", f"disk:{disk_dir}?max_bytes=64GiB"])
    memory_tier = engine.store.tiers[0]
    pool = corpus_chunks(engine)
    rng = random.Random(seed)
    rows = []
    for target in lengths:
        k = max(1, (target - 60) // 260)
        if k > len(pool):
            break
        w = Workload(engine, rng.sample(pool, k))

        def pc(mode, prompt=w.prompt, ratio=0.15):
            return lambda: engine.next_token_logits(prompt, mode=mode, recompute_ratio=ratio)

        engine.store.clear()
        t0 = time.perf_counter()
        engine.warm(w.chunks, progress=False)
        warm_s = time.perf_counter() - t0
        chunk_tokens = sum(len(engine.segmenter.ids(c)) for c in w.chunks)
        engine.generate(build_prompt(w.chunks[::-1]), mode="modular", max_new_tokens=1)  # system text node
        row = {"prompt_tokens": len(w.ids), "chunks": k, "question_tokens": w.q}
        row["hf_full"] = timeit(w.hf_full, reps)
        row["hf_prefix"] = timeit(w.hf_prefix, reps)
        row["ideal"] = w.ideal(reps)
        row["pc_full"] = timeit(pc("full"), reps)
        row["pc_modular_warm_memory"] = timeit(pc("modular"), reps)
        row["pc_modular_warm_disk"] = timeit(pc("modular"), reps, setup=memory_tier.clear)
        engine.blend_selection = "deviation"
        for ratio in BLEND_RATIOS:
            row[f"pc_blend_{ratio}"] = timeit(pc("blend", ratio=ratio), reps)
        engine.blend_selection = "chunk_start"
        for ratio in CHUNK_START_RATIOS:
            row[f"pc_blend_{ratio}_chunk_start"] = timeit(pc("blend", ratio=ratio), reps)
        engine.generate(w.prompt, mode="exact", max_new_tokens=1)
        row["pc_exact_warm_memory"] = timeit(pc("exact"), reps)
        row["pc_exact_warm_disk"] = timeit(pc("exact"), reps, setup=memory_tier.clear)
        row["pc_modular_cold"] = timeit(pc("modular"), max(1, reps // 2), setup=engine.store.clear)

        for mode in ("full", "exact", "modular"):  # reuse only changes the prefill: these must agree
            gen = engine.generate(w.prompt, mode=mode, max_new_tokens=33)
            row[f"pc_{mode}_decode_tokens_per_s"] = gen.decode_tokens_per_s
        row["hf_decode_tokens_per_s"] = w.hf_decode_tokens_per_s(32)
        row["warm_tokens_per_s"] = chunk_tokens / warm_s
        row["full_prefill_tokens_per_s"] = len(w.ids) / row["hf_full"]["median_s"]
        row["disk_load_GBps"] = _disk_load_gbps(engine, memory_tier, w.chunks)
        row["speedup_modular_vs_hf_full"] = row["hf_full"]["median_s"] / row["pc_modular_warm_memory"]["median_s"]
        row["modular_over_ideal"] = row["pc_modular_warm_memory"]["median_s"] / row["ideal"]["median_s"]
        row["exact_over_ideal"] = row["pc_exact_warm_memory"]["median_s"] / row["ideal"]["median_s"]
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

    sink = engine.assembler.sink_ids
    keys = [chunk_key(engine.runner.fingerprint, engine.segmenter.ids(c), sink, len(sink)) for c in chunks]
    disk = engine.store.tiers[1]
    memory_tier.clear()
    t0 = time.perf_counter()
    nbytes = sum(disk.get(k).nbytes for k in keys)
    return nbytes / (time.perf_counter() - t0) / 1e9


def _row_line(row):
    ms = {k: round(v["median_s"] * 1000, 1) for k, v in row.items() if isinstance(v, dict)}
    rest = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if not isinstance(v, dict)}
    return json.dumps(rest | {"median_ms": ms})


COLUMNS = [("hf_full", "HF full prefill"), ("hf_prefix", "HF prefix reuse (deepcopy)"),
           ("pc_full", "pc_rag full"), ("pc_exact_warm_memory", "exact warm (memory)"),
           ("pc_exact_warm_disk", "exact warm (disk)"),
           ("pc_modular_cold", "modular cold"), ("pc_modular_warm_memory", "modular warm (memory)"),
           ("pc_modular_warm_disk", "modular warm (disk)"),
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
        cells = [f"{r[k]['median_s'] * 1000:.1f}" for k, _ in COLUMNS]
        lines.append(f"| {r['prompt_tokens']} | " + " | ".join(cells)
                     + f" | {r['speedup_modular_vs_hf_full']:.1f}x | {r['modular_over_ideal']:.2f} |")
    lines += ["", "| prompt tokens | decode tok/s full | decode tok/s exact | decode tok/s modular | decode tok/s HF "
              "| chunk warm-up tok/s | full prefill tok/s | disk load GB/s |", "|---" * 8 + "|"]
    for r in result["rows"]:
        decode = " | ".join(f"{r[f'pc_{m}_decode_tokens_per_s']:.1f}" for m in ("full", "exact", "modular"))
        lines.append(f"| {r['prompt_tokens']} | {decode} | {r['hf_decode_tokens_per_s']:.1f} "
                     f"| {r['warm_tokens_per_s']:.0f} | {r['full_prefill_tokens_per_s']:.0f} "
                     f"| {r['disk_load_GBps']:.2f} |")
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


def model_or_bench(model: str | None, out: Path):
    """The checkpoint to measure: `model`, else the offline 'bench' Llama, built once under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    if model is not None:
        return model
    path = out / "bench-model"
    if not (path / "config.json").exists():
        pc_rag.testing.build_tiny_llama(path, size="bench")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the offline 'bench' Llama under --out)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    model = model_or_bench(args.model, out)
    result = run(model, args.lengths, args.reps, args.dtype, args.device)
    (out / "ttft.json").write_text(json.dumps(result, indent=2))
    (out / "ttft.md").write_text(markdown(result))
    plot(result, out / "ttft.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
