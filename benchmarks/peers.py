"""pc_rag side by side with what its users would run instead: vLLM's CPU engine and llama.cpp, same token ids.

    bash benchmarks/peers_env.sh /tmp/peers          # once: the peers' virtualenvs and GGUF files (~25 minutes)
    python -m benchmarks.peers --peers /tmp/peers --size bench --dtype float32 bfloat16 --reps 5
    python -m benchmarks.peers --peers /tmp/peers --size large --dtype bfloat16 --reps 2 --workloads system rag chat
    python -m benchmarks.peers --peers /tmp/peers --size large 1b --dtype bfloat16 --quant Q8_0 Q4_0 Q4_K_M --skip vllm

With --quant, both run the same GGUF file, made by llama.cpp's own converter (f16) and quantizer (llama-quantize's
types, through llama-cpp-python): pc_rag keeps its matrices quantized (docs/models.md), llama.cpp runs it as its
users do. Each result then also holds the resident memory loading the model added to a fresh process (pc_rag: a
subprocess that loads it; llama.cpp: its worker), and the last token's logits of one prompt on both, against each
other and against the float checkpoint (pc_rag, fp32) the file was made from.

Every system gets the same prompts as token ids (pc_rag gets the segments those ids come from and is checked to
see exactly them), greedy decoding of exactly the requested number of tokens (EOS ignored: random weights), and
the machine to itself (one system at a time; pc_rag in this process, each peer in its own virtualenv through
benchmarks/peer_worker.py). A peer whose virtualenv is missing is skipped, and the table says so.

Workloads (medians over --reps requests, each with text no earlier request had where it should not be cached):
- system: a 2K-token system prompt seen before, a new 30-token question (TTFT). pc_rag: modular and exact.
- rag: 8 chunks of ~256 tokens seen before in another order, a new question (TTFT). pc_rag: modular.
- cold4k / cold8k: a prompt of that many tokens no one has seen (TTFT).
- decode: 128 tokens after a 4K-token prompt (tokens/s after the first).
- chat: turns 2-4 of a chat whose previous prompt and reply were seen (TTFT, median over the turns).
- e2e_rag: the rag request answered with 200 tokens (seconds to the last token).
Beside each row, the physical bound on this machine: FLOPs at the measured matrix-product rate for the tokens a
system must compute (for reuse rows: only the new ones), weight + KV bytes per token at the measured memory
bandwidth for decoding. And where pc_rag's time goes (`profile`): a cold 4K prefill and decode steps by op kind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model import kernels

from .common import common_prefix

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("system", "rag", "cold4k", "cold8k", "decode", "chat", "e2e_rag")
PEERS = ("vllm", "llamacpp")
GGUF_TYPE = {"float32": "f32", "bfloat16": "f16"}  # what llama.cpp users run for each (FIELD-NOTES: f16 on CPU)


@dataclass
class Request:
    """One request as every system runs it: pc_rag's segments, the same prompt as ids for the peers."""

    prompt: list  # pc_rag segments
    ids: list[int]
    new_tokens: int = 1
    reset: bool = False  # empty the peers' prefix caches first (pc_rag's prompts are new text anyway)
    timed: str | None = None  # the workload this request is measured for (None: a warm-up)
    mode: str = "modular"


@dataclass
class Plan:
    requests: list[Request] = field(default_factory=list)

    def add(self, engine, prompt, **kw) -> Request:
        r = Request(prompt, [t for s in engine.segmenter.segments(prompt) for t in s.token_ids], **kw)
        self.requests.append(r)
        return r


class Texts:
    """Real text (Python's own docs) cut to token counts, never the same piece twice."""

    def __init__(self, engine, seed: int):
        ids = [t for text in pc_rag.testing.pydoc_corpus() for t in engine.segmenter.ids(text)]
        self.engine, self.ids = engine, ids
        self.at = random.Random(seed).randrange(len(ids) // 4)

    def take(self, tokens: int) -> str:
        if self.at + tokens > len(self.ids):
            self.at = 0
        piece = self.ids[self.at: self.at + tokens]
        self.at += tokens
        return self.engine.tokenizer.decode(piece).strip()


def plan_workloads(engine, names, reps: int, seed: int = 0) -> Plan:
    texts, plan = Texts(engine, seed), Plan()
    question = lambda i: Text(f"\n\nQuestion {i}: {texts.take(24)}\nAnswer:")  # noqa: E731 (~30 tokens)
    if "system" in names:
        system = Text(texts.take(2000))
        plan.add(engine, [system, question(0)], reset=True)
        for mode in ("modular", "exact"):
            for i in range(reps):
                plan.add(engine, [system, question(i + 1)], timed=f"system:{mode}", mode=mode)
    if "rag" in names or "e2e_rag" in names:
        head = Text("Answer from the documents below.\n\n")
        docs = [texts.take(256) for _ in range(8)]
        rng = random.Random(seed)

        def rag(i, order, **kw):
            parts = [head]
            for d in order:
                parts += [Chunk(docs[d]), Text("\n\n")]
            return plan.add(engine, [*parts[:-1], question(i)], **kw)

        rag(0, range(8), reset=True)  # the chunks seen once, in this order
        for i in range(reps):
            order = list(range(8))
            while order == sorted(order):
                rng.shuffle(order)
            if "rag" in names:
                rag(100 + i, order, timed="rag")
            if "e2e_rag" in names:
                rag(200 + i, order[::-1], timed="e2e_rag", new_tokens=200)
    for n in (4096, 8192):
        if f"cold{n // 1024}k" in names:
            for _ in range(reps):
                plan.add(engine, [Text(texts.take(n - 1))], reset=True, timed=f"cold{n // 1024}k")
    if "decode" in names:
        for _ in range(reps):
            plan.add(engine, [Text(texts.take(4095))], reset=True, new_tokens=128, timed="decode")
    if "chat" in names:
        for _ in range(reps):
            turns = [Text("You are a helpful assistant.\n\n")]
            for k in range(4):
                turns.append(Text(f"User: {texts.take(60)}\nAssistant:"))
                if k:  # turn k+1 after turn k's prompt and reply were seen
                    plan.add(engine, list(turns), new_tokens=1, timed="chat")
                turns.append(Text(" " + texts.take(48) + "\n\n"))
                plan.add(engine, list(turns), new_tokens=1, reset=not k)  # the reply is part of what was seen
    return plan


# ---- pc_rag ------------------------------------------------------------------------------------------------------
def run_pc_rag(engine, plan: Plan) -> list[dict]:
    engine.eos_ids = frozenset()  # exactly new_tokens tokens, as the peers are asked for
    out = []
    for r in plan.requests:
        t0 = time.perf_counter()
        g = engine.generate(r.prompt, mode=r.mode, max_new_tokens=r.new_tokens)
        total = time.perf_counter() - t0
        if list(g.prompt_ids) != r.ids:
            raise RuntimeError("pc_rag saw other token ids than the peers get")
        out.append({"ttft_s": g.ttft_s, "total_s": total, "tokens": list(g.token_ids)})
    return out


# ---- peers -------------------------------------------------------------------------------------------------------
def peer_python(peers: Path, peer: str) -> Path | None:
    python = peers / peer / "bin" / "python"
    module = {"vllm": "vllm", "llamacpp": "llama_cpp"}[peer]
    if not python.exists():
        return None
    ok = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0
    return python if ok else None


def gguf(peers: Path, model: Path, dtype: str, work: Path) -> Path | None:
    """The model as GGUF for llama.cpp (converted once with the converter peers_env.sh put under --peers)."""
    kind = GGUF_TYPE[dtype]
    path = (work / f"{model.name}-{kind}.gguf").resolve()  # the converter runs in its own folder
    if path.exists():
        return path
    convert = peers / "convert"
    if not (convert / "convert_hf_to_gguf.py").exists():
        return None
    env = {**os.environ, "PYTHONPATH": str(convert / "gguf-py")}
    done = subprocess.run([sys.executable, "convert_hf_to_gguf.py", str(model.resolve()), "--outtype", kind,
                           "--outfile", str(path) + ".tmp"], cwd=convert, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"[peers] GGUF conversion failed: {done.stderr[-2000:]}", file=sys.stderr)
        return None
    os.replace(str(path) + ".tmp", path)
    return path


QUANT_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M"}
QUANTIZE = """import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, sys.argv[3])
p.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def quantized_gguf(peers: Path, model: Path, kind: str, work: Path) -> Path | None:
    """The model as a GGUF of llama-quantize's type `kind`, from the f16 conversion, by llama.cpp's own quantizer."""
    path = (work / f"{model.name}-{kind}.gguf").resolve()
    if path.exists():
        return path
    f16, python = gguf(peers, model, "bfloat16", work), peer_python(peers, "llamacpp")
    if f16 is None or python is None:
        return None
    done = subprocess.run([str(python), "-c", QUANTIZE, str(f16), str(path) + ".tmp", QUANT_FTYPES[kind],
                           str(torch.get_num_threads())], capture_output=True, text=True)
    if done.returncode:
        print(f"[peers] quantizing to {kind} failed: {done.stderr[-2000:]}", file=sys.stderr)
        return None
    os.replace(str(path) + ".tmp", path)
    return path


LOAD_RSS = """import json, sys, gc
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
import torch, pc_rag
# The libraries every pc_rag process has loaded before any model (as llama.cpp's side counts from after
# `import llama_cpp`): pc_rag's native kernels and transformers' modeling code (~120 MiB of it).
pc_rag.model.kernels.loaded()
import transformers.modeling_utils, transformers.generation, transformers.modeling_gguf_pytorch_utils
before = rss()
engine = pc_rag.Engine.from_pretrained(sys.argv[1], dtype=sys.argv[2], store="memory")
gc.collect()
print(json.dumps({"load_rss_mib": rss() - before, "model": engine.stats()["model"]}))
"""


def pc_rag_load_rss(model: Path, dtype: str) -> dict:
    """What loading the model adds to a fresh process's resident memory, and what engine.stats() says it holds."""
    done = subprocess.run([sys.executable, "-c", LOAD_RSS, str(model), dtype], capture_output=True, text=True,
                          check=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_peer(python: Path, peer: str, model: str, dtype: str, plan: Plan, max_len: int,
             logits_ids: list[int] | None = None) -> dict:
    """{"requests": per request, "load_rss_mib": what the model added (llama.cpp), "logits": of `logits_ids`}."""
    spec = {"model": model, "dtype": dtype, "max_len": max_len, "threads": torch.get_num_threads(),
            "requests": [{"ids": r.ids, "new_tokens": r.new_tokens, "reset": r.reset} for r in plan.requests],
            "logits_ids": logits_ids}
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "requests.json", Path(tmp) / "results.json"
        req.write_text(json.dumps(spec))
        env = dict(os.environ)
        tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
        if peer == "vllm" and os.path.exists(tcmalloc):  # vLLM's CPU docs ask for it
            env["LD_PRELOAD"] = tcmalloc
        subprocess.run([str(python), str(REPO / "benchmarks" / "peer_worker.py"), peer, str(req), str(res)],
                       env=env, check=True)
        return json.loads(res.read_text())


# ---- the machine's bounds ----------------------------------------------------------------------------------------
def machine_rates(dtype: torch.dtype) -> dict:
    """Measured here: matrix products (GFLOP/s, a prefill-shaped product) and memory reads (GB/s)."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    big = torch.randn(256 << 20, dtype=torch.float32)  # 1 GiB: far beyond the caches

    def best(fn, n):
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {"matmul_gflops": 2 * 2048 ** 3 / best(lambda: a @ b, 10) / 1e9,
            "read_gbps": big.nbytes / best(big.sum, 5) / 1e9}


def model_costs(config, dtype: torch.dtype) -> dict:
    """FLOPs and bytes the forward passes must at least move, from the config."""
    h, L = config.hidden_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    layer = h * d * (2 * hq + 2 * hkv) + 3 * h * config.intermediate_size
    size = torch.finfo(dtype).bits // 8
    return {"layer_params": L * layer, "head_params": h * config.vocab_size, "L": L, "hq": hq, "d": d,
            "kv_bytes_per_token": 2 * L * hkv * d * size, "bytes_per_param": size}


def prefill_s(c, rates, new: int, before: int) -> float:
    """Seconds to compute `new` tokens after `before` cached ones at the measured rate (causal attention)."""
    linear = 2 * c["layer_params"] * new + 2 * c["head_params"]  # the head for the last token only
    ctx = new * before + new * new / 2  # query-key pairs
    attention = 4 * c["L"] * c["hq"] * c["d"] * ctx
    return (linear + attention) / (rates["matmul_gflops"] * 1e9)


def decode_tok_s(c, rates, ctx: int) -> float:
    step = (c["layer_params"] + c["head_params"]) * c["bytes_per_param"] + ctx * c["kv_bytes_per_token"]
    return rates["read_gbps"] * 1e9 / step


# ---- where pc_rag's time goes ------------------------------------------------------------------------------------
def profile(engine, texts: Texts) -> dict:
    """Per op kind, milliseconds of a cold 4K-token prefill and of one decode step after it (mean of 16), and what
    is left of the wall time outside torch's ops (Python, the engine's own work)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ours = (kernels.PROFILE_NAME, kernels.PREFILL_PROFILE_NAME)  # pc_rag's own attention kernels
    products = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", kernels.LINEAR_PROFILE_NAME,
                kernels.QUANT_PROFILE_NAME, kernels.DEQUANT_PROFILE_NAME)  # quantized weights' products and decoding

    # A decode step's layers in one native call (fused.py): its products, attention and small ops together.
    layers = kernels.LAYERS_PROFILE_NAME

    def kinds(prof, wall_s, per):
        out = {"matmul": 0.0, "attention": 0.0, "native layers": 0.0, "other ops": 0.0}
        for e in prof.key_averages():
            if e.key.startswith(("aten::", "mkldnn::")) or e.key in ours or e.key in products or e.key == layers:
                kind = ("matmul" if e.key in products else
                        "attention" if "scaled_dot_product" in e.key or e.key in ours else
                        "native layers" if e.key == layers else
                        "other ops")
                out[kind] += e.self_cpu_time_total / 1e3 / per
        out["outside ops"] = max(0.0, wall_s * 1e3 / per - sum(out.values()))
        out["wall"] = wall_s * 1e3 / per
        return {k: round(v, 2) for k, v in out.items()}

    engine.eos_ids = frozenset()
    n = min(4096, engine.runner.shape.max_positions - 64)  # a shorter prompt where the model's context is shorter
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        g = engine.generate([Text(texts.take(n - 1))], mode="full", max_new_tokens=1)
    prefill = kinds(prof, g.ttft_s, 1)
    runner = engine.runner
    cache = runner.acquire_cache(n + 32)
    try:
        runner.forward(cache, [1] * n, list(range(n)), list(range(n)))
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for i in range(n, n + 16):  # the decode loop's own step, one request
                runner.decode_batch([cache], [1], [i], [i])
            wall = time.perf_counter() - t0
    finally:
        runner.release_cache(cache)
    decode = kinds(prof, wall, 16)
    return {"cold_prefill_4k_ms": prefill, "decode_step_after_4k_ms": decode}


# ---- one configuration -------------------------------------------------------------------------------------------
def measure(model: Path, dtype: str, names, reps: int, peers: Path, work: Path, skip_peers=(),
            float_model: Path | None = None) -> dict:
    """One configuration. `model` is a checkpoint folder, or (with --quant) a GGUF file both systems run, made from
    the checkpoint `float_model`."""
    quantized = model.suffix == ".gguf"
    engine = pc_rag.Engine.from_pretrained(model, dtype=dtype, store="memory")
    plan = plan_workloads(engine, names, reps)
    max_len = min(engine.runner.shape.max_positions, 16384)
    logits_ids = plan.requests[0].ids[:256]
    systems, notes, peer_extra = {"pc_rag": run_pc_rag(engine, plan)}, [], {}
    for peer in PEERS:
        if peer in skip_peers:
            notes.append(f"{peer}: skipped (--skip)")
            continue
        if quantized and peer == "vllm":
            notes.append("vllm: skipped (its CPU engine does not run llama.cpp's quantized GGUF files)")
            continue
        python = peer_python(peers, peer)
        if python is None:
            notes.append(f"{peer}: skipped (no working virtualenv under {peers / peer}; see benchmarks/peers_env.sh)")
            continue
        target = model if quantized else str(model) if peer == "vllm" else gguf(peers, model, dtype, work)
        if target is None:
            notes.append(f"{peer}: skipped (no GGUF converter under {peers / 'convert'})")
            continue
        if peer == "llamacpp" and kernels.has_amx():
            notes.append("llamacpp: built without AMX (benchmarks/peers_env.sh): its AMX products crashed here "
                         "(SIGSEGV in ggml_backend_amx_mul_mat)")
        try:
            done = run_peer(python, peer, str(target), dtype, plan, max_len, logits_ids if quantized else None)
            systems[peer], peer_extra[peer] = done["requests"], done
        except subprocess.CalledProcessError as e:
            notes.append(f"{peer}: failed ({e})")
    extra = {}
    if quantized:
        extra["memory_mib"] = {"file": model.stat().st_size / 2**20, "pc_rag": pc_rag_load_rss(model, dtype),
                               "llamacpp": (peer_extra.get("llamacpp") or {}).get("load_rss_mib")}
        extra["logits"] = compare_logits(engine, logits_ids, (peer_extra.get("llamacpp") or {}).get("logits"),
                                         float_model)
    tdtype = pc_rag.model.parse_dtype(dtype)
    rates = machine_rates(tdtype)
    costs = model_costs(engine.model.config, tdtype)
    if quantized:  # a decode step reads the quantized bytes
        costs["bytes_per_param"] = engine.stats()["model"]["bytes"] / (costs["layer_params"] + costs["head_params"])
    rows = summarize(plan, systems, costs, rates)
    prof = profile(engine, Texts(engine, seed=99))
    params = float_params(float_model) if quantized else sum(p.numel() for p in engine.model.parameters())
    return {"model": str(model), "params": params, "dtype": dtype,
            "rates": {k: round(v, 1) for k, v in rates.items()}, "rows": rows, "notes": notes,
            "profile": prof, "same_greedy_tokens": agreement(plan, systems),
            "first_difference": divergence_margins(engine, plan, systems), **extra}


def float_params(model: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())


def last_logits(engine, ids: list[int]) -> torch.Tensor:
    runner = engine.runner
    cache = runner.acquire_cache(len(ids) + 1)
    try:
        return runner.forward(cache, ids, list(range(len(ids))), list(range(len(ids)))).float()
    finally:
        runner.release_cache(cache)


def compare_logits(engine, ids: list[int], theirs: list[float] | None, float_model: Path) -> dict:
    """The last token's logits of one prompt: pc_rag on the quantized file against llama.cpp on it, and each
    against the float checkpoint run by pc_rag in fp32 (the quantization's own error)."""
    ours = last_logits(engine, ids)
    reference = last_logits(pc_rag.Engine.from_pretrained(float_model, dtype="float32", store="memory"), ids)
    out = {"logit_scale": round(float(reference.abs().max()), 3),
           "pc_rag_vs_float_max_abs": round(float((ours - reference).abs().max()), 4)}
    if theirs is not None:
        theirs = torch.tensor(theirs[: ours.numel()])
        out |= {"pc_rag_vs_llamacpp_max_abs": round(float((ours - theirs).abs().max()), 4),
                "llamacpp_vs_float_max_abs": round(float((theirs - reference).abs().max()), 4),
                "same_argmax": bool(ours.argmax() == theirs.argmax())}
    return out


def divergence_margins(engine, plan: Plan, systems: dict) -> dict:
    """Where each peer's greedy tokens first part from pc_rag's, on the request with the longest answer: pc_rag's
    margin there between its top two tokens (nats), against the median margin over that answer's steps. A parting
    at a margin far below the median is a near tie, where either system's rounding may pick the other token."""
    i = max(range(len(plan.requests)), key=lambda j: plan.requests[j].new_tokens)
    r = plan.requests[i]
    g = engine.generate(r.prompt, mode=r.mode, max_new_tokens=r.new_tokens, logprobs=2)
    margins = [lp.top[0].logprob - lp.top[1].logprob for lp in g.logprobs if len(lp.top) > 1]
    out = {}
    for name, res in systems.items():
        if name == "pc_rag" or not margins:
            continue
        ours, theirs = list(g.token_ids), res[i]["tokens"]
        k = next((j for j in range(min(len(ours), len(theirs))) if ours[j] != theirs[j]), None)
        out[name] = {"first_difference": k, "margin_there": None if k is None else round(margins[k], 4),
                     "median_margin": round(statistics.median(margins), 4)}
    return out


def agreement(plan: Plan, systems: dict) -> dict:
    """Share of decoded tokens equal to pc_rag's (the same weights and greedy decoding: a sanity check that every
    system runs the same model, not a quality measure; half precision may diverge after a near tie)."""
    out = {}
    for name, res in systems.items():
        if name == "pc_rag":
            continue
        same = total = 0
        for r, ours, theirs in zip(plan.requests, systems["pc_rag"], res, strict=True):
            n = min(len(ours["tokens"]), len(theirs["tokens"]))
            k = next((i for i in range(n) if ours["tokens"][i] != theirs["tokens"][i]), n)
            same += k
            total += r.new_tokens
        out[name] = round(same / total, 3) if total else None
    return out


def summarize(plan: Plan, systems: dict, costs: dict, rates: dict) -> list[dict]:
    rows = []
    labels = sorted({r.timed for r in plan.requests if r.timed}, key=lambda s: (WORKLOADS.index(s.split(":")[0]), s))
    for label in labels:
        idx = [i for i, r in enumerate(plan.requests) if r.timed == label]
        base = label.split(":")[0]
        row = {"workload": label}
        for name, res in systems.items():
            if name != "pc_rag" and ":" in label and not label.endswith(":modular"):
                continue  # pc_rag's second mode has no peer counterpart
            if base == "decode":
                row[name] = statistics.median((plan.requests[i].new_tokens - 1) / (res[i]["total_s"] - res[i]["ttft_s"])
                                              for i in idx)
            elif base == "e2e_rag":
                row[name] = statistics.median(res[i]["total_s"] for i in idx) * 1e3
            else:
                row[name] = statistics.median(res[i]["ttft_s"] for i in idx) * 1e3
        r0 = plan.requests[idx[0]]
        n = len(r0.ids)
        if base == "decode":
            row["bound"] = decode_tok_s(costs, rates, n + 64)
        elif base in ("cold4k", "cold8k"):
            row["bound"] = prefill_s(costs, rates, n, 0) * 1e3
        else:  # what a prefix cache must still compute: the tokens after the longest prefix seen before
            seen = max((common_prefix(r.ids, r0.ids) for r in plan.requests[: idx[0]]), default=0)
            row["bound"] = prefill_s(costs, rates, n - seen, seen) * 1e3
            row["bound_note"] = f"{n - seen} of {n} tokens new to a prefix cache"
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    names = ["pc_rag", "vllm", "llamacpp"]
    title = {"pc_rag": "pc_rag", "vllm": "vLLM CPU", "llamacpp": "llama.cpp"}
    quant = f", {Path(result['model']).stem.rsplit('-', 1)[-1]} GGUF" if result["model"].endswith(".gguf") else ""
    lines = [f"### {result['params'] / 1e6:.0f}M parameters, {result['dtype']}{quant} "
             f"(matmul {result['rates']['matmul_gflops']:.0f} GFLOP/s, reads {result['rates']['read_gbps']:.0f} GB/s)",
             "", "| workload | " + " | ".join(title[n] for n in names) + " | pc_rag vs best peer | bound |",
             "|---|" + "---|" * (len(names) + 2)]
    for row in result["rows"]:
        rate = row["workload"].startswith("decode")
        unit = " tok/s" if rate else " ms"
        cells = [f"{row[n]:,.0f}{unit}" if n in row else "-" for n in names]
        peers = [row[n] for n in ("vllm", "llamacpp") if n in row]
        if peers and "pc_rag" in row:
            best = max(peers) if rate else min(peers)
            ratio = row["pc_rag"] / best if rate else best / row["pc_rag"]
            vs = f"{ratio:.2f}x"
        else:
            vs = "-"
        bound = f"{row['bound']:,.0f}{unit}"
        lines.append(f"| {row['workload']} | " + " | ".join(cells) + f" | {vs} | {bound} |")
    lines += ["", "pc_rag vs best peer: above 1 is pc_rag ahead (time: best peer's / ours; tok/s: ours / best peer's).",
              "Bound: FLOPs of the tokens to compute at the measured matmul rate (reuse rows: the tokens after the "
              "longest prefix seen before), or weight + KV bytes per decode step at the measured read rate."]
    for note in result["notes"]:
        lines.append(f"- {note}")
    if "memory_mib" in result:
        mem = result["memory_mib"]
        lc = f"{mem['llamacpp']:,.0f} MiB" if mem.get("llamacpp") is not None else "-"
        lines.append(f"- Memory the loaded model adds to a process: pc_rag {mem['pc_rag']['load_rss_mib']:,.0f} MiB "
                     f"(its tensors {mem['pc_rag']['model']['bytes'] / 2**20:,.0f} MiB: "
                     f"{mem['pc_rag']['model']['matrices']}), llama.cpp {lc}; the file {mem['file']:,.0f} MiB.")
    if "logits" in result:
        lg = result["logits"]
        lines.append(f"- Last-token logits of one prompt (scale {lg['logit_scale']}): pc_rag vs llama.cpp max |diff| "
                     f"{lg.get('pc_rag_vs_llamacpp_max_abs', '-')} (same argmax: {lg.get('same_argmax', '-')}); "
                     f"against the float checkpoint: pc_rag {lg['pc_rag_vs_float_max_abs']}, llama.cpp "
                     f"{lg.get('llamacpp_vs_float_max_abs', '-')}.")
    agree = ", ".join(f"{title[k]} {v:.0%}" for k, v in result["same_greedy_tokens"].items() if v is not None)
    if agree:
        lines.append(f"- Greedy tokens equal to pc_rag's until the first difference: {agree}.")
    for peer, d in result.get("first_difference", {}).items():
        if d["first_difference"] is not None:
            lines.append(f"- {title[peer]} first parts from pc_rag at token {d['first_difference']} of the longest "
                         f"answer, where pc_rag's top two tokens were {d['margin_there']} nats apart (median over the "
                         f"answer: {d['median_margin']}).")
    lines += ["", "Where pc_rag's time goes (ms, torch profiler; 'outside ops' is Python and the engine's own work):",
              "", "| | " + " | ".join(next(iter(result["profile"].values()))) + " |",
              "|---|" + "---|" * len(next(iter(result["profile"].values())))]
    for what, kinds in result["profile"].items():
        lines.append(f"| {what} | " + " | ".join(f"{v:,.1f}" for v in kinds.values()) + " |")
    return "\n".join(lines) + "\n"


def model_dir(size: str, work: Path) -> Path:
    path = work / f"{size}-model"
    if not (path / "config.json").exists():
        pc_rag.testing.build_tiny_llama(path, size=size, seed=0)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=os.environ.get("PC_RAG_PEERS", "/tmp/peers"),
                    help="where benchmarks/peers_env.sh built the peers' virtualenvs")
    ap.add_argument("--size", nargs="+", default=["bench"], choices=["bench", "large", "1b"],
                    help="the offline model's shapes (large: Qwen2.5-0.5B's layers, 0.37B; 1b: Llama 3.2 1B's)")
    ap.add_argument("--quant", nargs="*", default=[], choices=sorted(QUANT_FTYPES),
                    help="run both systems on GGUF files of these llama-quantize types instead of the float model")
    ap.add_argument("--model", help="an HF checkpoint dir instead of --size")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=PEERS, help="peers not to run")
    ap.add_argument("--out", default="bench_out/peers")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = [Path(args.model)] if args.model else [model_dir(size, out) for size in args.size]
    results = []
    for model in models:
        for dtype in args.dtype:
            files = [quantized_gguf(Path(args.peers), model, kind, out) for kind in args.quant] or [model]
            for target in files:
                if target is None:
                    print(f"[peers] no GGUF for {model} (llama.cpp's converter or quantizer missing)", file=sys.stderr)
                    continue
                result = measure(target, dtype, args.workloads, args.reps, Path(args.peers), out, args.skip,
                                 float_model=model)
                results.append(result)
                print(markdown(result), flush=True)
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__}, "results": results}
    stem = f"peers-{'-'.join(m.name for m in models)}{'-' + '-'.join(args.quant) if args.quant else ''}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text("\n".join(markdown(r) for r in results))


if __name__ == "__main__":
    main()
