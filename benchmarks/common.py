"""What the benchmarks share: the workloads (real text in chunks, prompts, HF-side references), the timing
(interleaved runs, per-step timers of a request), a local Redis, and the model to measure.

Run a benchmark as a module from the repository root, `python -m benchmarks.<name> --help`:

    ttft        TTFT side by side: HF baselines, every mode warm and cold, from memory, disk and Redis, the ideal
    prefix      automatic prefix reuse: a repeated system prompt, per block size, from memory and from disk
    flows       how much the stock LangChain and LlamaIndex flows reuse, next to how much they could
    fidelity    how far each mode moves the next-token distribution from `full`
    loads       prefetch on retrieval, and compressed (int8) blocks: bytes, load time, fidelity
    blend_cost  what each blend setting costs in TTFT and work
    accuracy    answer accuracy per mode on the trained retrieval model (train_retrieval, retrieval_task)
    concurrency concurrent streams, batched decoding against one at a time, in-process and over HTTP
    report      docs/results.md's tables and docs/ttft.png from the JSON files the others write
"""

from __future__ import annotations

import contextlib
import copy
import random
import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model.hf import with_cache

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


def workloads(engine, lengths, seed):
    """A Workload per target length (of ~256-token chunks of real text), the same ones for the same seed."""
    pool = corpus_chunks(engine)
    rng = random.Random(seed)
    for target in lengths:
        k = max(1, (target - 60) // 260)
        if k > len(pool):
            return
        yield Workload(engine, rng.sample(pool, k))


def build_prompt(chunks):
    parts = [Text(SYSTEM)]
    for c in chunks:
        parts += [Chunk(c), Text("\n\n")]
    return parts[:-1] + [Text(QUESTION)]


def interleaved(cases, reps):
    """timeit for several cases measured in turn, one run of each per round (after one warm-up round), so that a
    shared machine's load drifting over a minute moves every case alike and their ratios hold. `cases`: name ->
    (fn, setup or None)."""
    times = {name: [] for name in cases}
    for i in range(reps + 1):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - t0
            if i:  # a Generation says its own TTFT (what the engine does after the reply is not in it)
                times[name].append(getattr(out, "ttft_s", wall))
    return {name: {"min_s": min(t), "median_s": statistics.median(t)} for name, t in times.items()}


def timeit(fn, reps, setup=None):
    """min and median seconds of `fn` over `reps` runs after one warm-up; `setup` runs untimed before each."""
    times = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        if i:
            times.append(getattr(out, "ttft_s", wall))  # as in `interleaved`
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
            model(input_ids=self.x[:, : self.n_sys], **with_cache(self.sys_cache))
            pre = DynamicCache(config=model.config)
            model(input_ids=self.x[:, : -self.q], **with_cache(pre))
        self.prefix_kv = [(layer.keys, layer.values) for layer in pre.layers]

    @torch.inference_mode()
    def hf_full(self):
        self.engine.model(input_ids=self.x, logits_to_keep=1)

    @torch.inference_mode()
    def hf_prefix(self):
        cache = copy.deepcopy(self.sys_cache)
        self.engine.model(input_ids=self.x[:, self.n_sys:], **with_cache(cache), logits_to_keep=1)

    def ideal_case(self):
        """(run, setup): the question alone over a ready DynamicCache (the copy is made in setup, untimed)."""
        caches = []

        def setup():
            caches[:] = [DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in self.prefix_kv])]

        @torch.inference_mode()
        def run():
            self.engine.model(input_ids=self.x[:, -self.q:], **with_cache(caches[0]), logits_to_keep=1)

        return run, setup

    def ideal(self, reps):
        run, setup = self.ideal_case()
        return timeit(run, reps, setup)

    @torch.inference_mode()
    def hf_generate_tokens_per_s(self, n):
        """HF `generate` (greedy, exactly n new tokens) over a DynamicCache holding the prompt but the question:
        (n - 1) tokens over the time of n new tokens minus the time of 1 (the question's prefill)."""
        def gen(k):
            cache = DynamicCache(ddp_cache_data=[(k_.clone(), v.clone()) for k_, v in self.prefix_kv])
            t0 = time.perf_counter()
            self.engine.model.generate(input_ids=self.x, **with_cache(cache), max_new_tokens=k, min_new_tokens=k,
                                       do_sample=False, pad_token_id=self.engine.tokenizer.eos_token_id)
            return time.perf_counter() - t0

        return (n - 1) / (gen(n) - gen(1))

    @torch.inference_mode()
    def hf_decode_tokens_per_s(self, n=32):
        """Greedy decode with HF's DynamicCache over the full prompt cache."""
        cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in self.prefix_kv])
        out = self.engine.model(input_ids=self.x[:, -self.q:], **with_cache(cache), logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = self.engine.model(input_ids=tok, **with_cache(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
        return n / (time.perf_counter() - t0)


@contextlib.contextmanager
def local_redis(url: str | None = "auto"):
    """A Redis URL for the benchmark: `url` as given, or with "auto" a redis-server without persistence started
    on a free local port for the duration (None when the binary is missing), or None for "none"."""
    if url != "auto":
        yield None if url in (None, "none") else url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)




class StepTimer:
    """Times the phases of an engine's requests: planning (store lookups, encoding misses), assembling (copy
    and relocation into the request buffer, then the forward), within it the disk blocks read straight into the
    request buffer (`direct`) and the forward alone, and storing blocks after the reply (`save`)."""

    def __init__(self, engine, before_save=None):
        self.engine = engine
        self.times = {"plan_s": 0.0, "encode_s": 0.0, "assemble_s": 0.0, "direct_s": 0.0, "forward_s": 0.0,
                      "save_s": 0.0}
        for obj, name, slot in self._steps():
            setattr(obj, name, self._timed(getattr(obj, name), slot))
        if before_save is not None:  # e.g. to read the tiers' counters before what follows the reply
            save = self.engine.assembler.save_prefix

            def saving(*args, **kwargs):
                before_save()
                return save(*args, **kwargs)
            self.engine.assembler.save_prefix = saving

    def _steps(self):
        asm = self.engine.assembler
        # encode_s: the misses encoded, inside assemble (reported with planning's lookups, as `plan`)
        return ((self.engine.planner, "plan", "plan_s"), (asm, "_encode", "encode_s"), (asm, "assemble", "assemble_s"),
                (asm, "_read", "direct_s"), (self.engine.runner, "forward", "forward_s"),
                (asm, "save_prefix", "save_s"))

    def _timed(self, fn, slot):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[slot] += time.perf_counter() - t0
        return wrapper

    def close(self):
        for obj, name, _ in self._steps():
            del obj.__dict__[name]


def emptied(engine, tier):
    """A setup that empties the memory tier `tier` and what the engine's pooled buffers still hold: the next request
    loads its blocks from the persistent tiers, as a new process would."""
    def setup():
        tier.clear()
        engine.runner.forget_held()
    return setup


def load_steps(engine, tier, fn, reps, clear):
    """Median per-request milliseconds of each step of `fn` (one request, memory emptied before each) served
    by the persistent tier `tier`: ttft, plan (lookups and encodes), `direct` (disk blocks read straight into
    the request buffer), the tier's wall time (`load`: in plan, or in direct) and the per-block sums of
    open/read/verify/decode and `tier_copy` (direct reads: copying into the request buffer; parallel: they may
    exceed `load`), copy (relocating keys and copying values of blocks in memory into the request buffer),
    forward, save (after the logits: storing blocks, promoting direct reads to memory); and the bytes read."""
    fields = ("load_s", "open_s", "read_s", "verify_s", "decode_s", "copy_s", "bytes_read")
    names = {"copy_s": "tier_copy_ms"}
    samples = []
    fn()
    for _ in range(reps):
        clear()
        before = tier.tier_stats()[0]
        replied = []  # the tier's counters when the reply was out: promotion reads after it are not the request's
        timer = StepTimer(engine, before_save=lambda r=replied: r or r.append(tier.tier_stats()[0]))
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            total = time.perf_counter() - t0
            timer.close()
        after = replied[0] if replied else tier.tier_stats()[0]
        t = timer.times
        # TTFT: the call without what follows the logits (storing the request's prefix blocks; promoting blocks
        # read from disk to memory, where the reads went straight into the request buffer), shown as save_ms.
        sample = {"ttft_ms": (total - t["save_s"]) * 1000, "save_ms": t["save_s"] * 1000,
                  "plan_ms": (t["plan_s"] + t["encode_s"]) * 1000, "direct_ms": t["direct_s"] * 1000,
                  "copy_ms": (t["assemble_s"] - t["encode_s"] - t["direct_s"] - t["forward_s"]) * 1000,
                  "forward_ms": t["forward_s"] * 1000}
        for f in fields:
            delta = getattr(after, f, 0) - getattr(before, f, 0)
            name = names.get(f, f.replace("_s", "_ms") if f.endswith("_s") else f)
            sample[name] = delta * 1000 if f.endswith("_s") else delta
        samples.append(sample)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def release_freed_memory() -> None:
    """Hands the memory of freed blocks back to the OS (glibc's malloc_trim), so that what the next request
    allocates is fresh memory to fault in, as in a new process; otherwise malloc reuses the pages of the blocks
    the memory tier just dropped, which a restarted process does not have. No-op without glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass




def model_or_bench(model: str | None, out: Path):
    """The checkpoint to measure: `model`, else the offline 'bench' Llama, built once under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    if model is not None:
        return model
    path = out / "bench-model"
    if not (path / "config.json").exists():
        pc_rag.testing.build_tiny_llama(path, size="bench")
    return path


def common_prefix(a, b) -> int:
    """How many leading items two sequences share (token ids: the tokens one prompt could reuse of another)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
