"""pc_rag's CUDA paths in one command: one table of checks, under 8 minutes on one GPU.

    python -m benchmarks.gpu_check                       # CUDA, bf16: a 1B-shaped Llama and a Gemma 3
    python -m benchmarks.gpu_check --device cpu --small  # the same checks on the tiny models, on the CPU

The models have random weights and are built offline in memory by pc_rag.testing (nothing is downloaded): the
Llama with Llama 3.2 1B's layers (SIZES["1b"]), the Gemma 3 at the bench shape with a 512-token sliding window on
6 of its 8 layers and its own RoPE table for local and global layers, so the ~5K-token prompts cross the window,
and the Llama again with its matrices quantized to Q4_K (quantize="q4_k"'s scheme, on the device).

Checks per model (tolerances: fp32 1e-4 of the largest |logit|; half precision 5e-2, since the two sides
round differently; a check also requires the same greedy tokens where it names them):
- full = HF: pc_rag's full prefill against HF's own forward of the model (`reference_logits`).
- exact = full: a prompt whose prefix an earlier request left behind; logits and 16 greedy tokens.
- relocation: the relocation self-check (per-layer key error of a probe moved by 1000 positions) and a lone
  chunk first in modular against full.
- disk -> device: blocks written to disk by one engine, read by another (memory over disk): the same modular
  logits as from memory, and the memory tier holds the promoted blocks on the model's device.
- batched decode: four concurrent greedy requests decode in shared steps to the tokens each gives alone; and four
  short ones, the later ones' prompts computed by the shared step with the decoding rows (`LlamaRunner.step`).
- TTFT ~5K: time to the first token's logits for a ~5K-token RAG prompt (the --small run: ~1.5K): HF's plain
  prefill (`model(input_ids)`) against pc_rag full, exact (prefix cached) and modular (chunks cached, in memory),
  medians of 3 after a warm-up. Timings only: no pass/fail.

Exit status 0 when every check passes (and when there is no CUDA device: it says so and runs nothing), 1 otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.store import MemoryStore
from pc_rag.testing import SIZES, pydoc_corpus, save_tokenizer, tiny_model

CHUNK_CHARS = 2400  # ~600 tokens of pydoc text with the bench tokenizer


@dataclass(frozen=True)
class Row:
    model: str
    check: str
    ok: bool | None  # None: a measurement, not a check
    detail: str


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--small", action="store_true", help="tiny models and a ~1.5K-token prompt (CPU-checkable)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run. "
              "`--device cpu --small` runs the same checks on tiny models on the CPU.")
        return 0
    dtype = pc_rag.model.parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    started = time.perf_counter()
    rows: list[Row] = []
    for name, (model, tok) in build_models(args.small, device, dtype).items():
        rows += check_model(name, model, tok, n_chunks=2 if args.small else 8)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, device, dtype, time.perf_counter() - started)
    return 0 if all(r.ok is not False for r in rows) else 1


def build_models(small: bool, device: torch.device, dtype: torch.dtype) -> dict:
    """{name: (model, tokenizer)}, random weights built on `device` in `dtype`."""
    llama_size, gemma_size = ("tiny", "tiny") if small else ("1b", "bench")  # each pair shares a vocabulary
    tok = save_tokenizer(Path(tempfile.mkdtemp(prefix="pc_rag_gpu_check_")), SIZES[llama_size])
    n = SIZES[gemma_size].num_layers
    kinds = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    gemma = dict(sliding_window=32 if small else 512, num_hidden_layers=n, layer_types=kinds)
    models = {}
    for name, family, size, changes in (("llama " + llama_size, "llama", llama_size, {}),
                                        ("gemma3 " + gemma_size, "gemma3_text", gemma_size, gemma)):
        with torch.device(device):
            model = tiny_model(family, tok, size, **changes).to(dtype).eval()
        models[name] = (model, tok)
    # The Llama again with its matrices quantized (Q4_K, the output Q6_K; quant.quantize_model, on the device): on
    # CUDA each product decodes its matrix with torch and multiplies by F.linear (weights.Quantized).
    with torch.device(device):
        model = tiny_model("llama", tok, llama_size).to(dtype).eval()
    pc_rag.model.quant.quantize_model(model, "q4_k")
    models[f"llama {llama_size} q4_k"] = (model, tok)
    return models


def check_model(name: str, model, tok, n_chunks: int) -> list[Row]:
    corpus = [t[:CHUNK_CHARS] for t in pydoc_corpus() if len(t) >= CHUNK_CHARS]
    docs = corpus[:n_chunks]
    tol = 1e-4 if model.dtype == torch.float32 else 5e-2
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    runner = engine.runner

    def prompt(order, question="Question: which of these mentions a keyword?\nAnswer:"):
        parts = [Text("You answer questions about Python.\n\n")]
        for i in order:
            parts += [Chunk(docs[i]), Text("\n\n")]
        return [*parts, Text(question)]

    def ids_of(p):
        return [t for s in engine.segmenter.segments(p) for t in s.token_ids]

    def rel(a, b):
        return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)

    rows = []
    order = list(range(len(docs)))
    # full = HF
    p = prompt(order)
    full, ref = engine.next_token_logits(p, "full"), runner.reference_logits(ids_of(p))
    e = rel(full, ref)
    rows.append(Row(name, "full = HF", e <= tol and int(full.argmax()) == int(ref.argmax()),
                    f"{len(ids_of(p))} tokens, rel diff {e:.1e} (tol {tol:g}), same next token: "
                    f"{int(full.argmax()) == int(ref.argmax())}"))
    # exact = full
    engine.generate(prompt(order, "An earlier question?"), mode="exact", max_new_tokens=1)
    exact_gen = engine.generate(p, mode="exact", max_new_tokens=16)
    full_gen = engine.generate(p, mode="full", max_new_tokens=16)
    e = rel(engine.next_token_logits(p, "exact"), full)
    same = exact_gen.token_ids == full_gen.token_ids
    rows.append(Row(name, "exact = full", e <= tol and same and exact_gen.cached_tokens > 0,
                    f"{exact_gen.cached_tokens} of {exact_gen.prompt_tokens} tokens cached, rel diff {e:.1e}, "
                    f"16 greedy tokens equal: {same}"))
    # relocation
    try:
        check = runner.check_relocation()
        lone = [Chunk(docs[0]), Text("\nWhat is it?")]
        engine.warm([docs[0]], progress=False)
        e = rel(engine.next_token_logits(lone, "modular"), engine.next_token_logits(lone, "full"))
        rows.append(Row(name, "relocation", check.ok and e <= tol,
                        f"self-check worst layer {check.layer}: {check.error:.1e} (tol {check.tolerance:g}), "
                        f"{check.ms:.0f} ms; lone chunk modular vs full rel diff {e:.1e}"))
    except pc_rag.UnsupportedModelError as err:
        rows.append(Row(name, "relocation", False, str(err)))
    # disk -> device
    rows.append(disk_row(name, model, tok, prompt(order[::-1]), docs, tol))
    # batched decode
    rows.append(batch_row(name, model, tok, [prompt([i % len(docs)], f"Question {i}?") for i in range(4)]))
    # short prompts: the later requests' whole prompts (under a prefill chunk) are computed by the shared step
    short = [[Text("You answer questions about Python.\n\n"), Chunk(docs[i % len(docs)][:400]),
              Text(f"\n\nQuestion {i}?")] for i in range(4)]
    rows.append(batch_row(name, model, tok, short, "newcomers in the step"))
    # TTFT
    rows.append(ttft_row(name, engine, prompt, ids_of, docs))
    return rows


def disk_row(name, model, tok, p, docs, tol) -> Row:
    with tempfile.TemporaryDirectory() as folder:
        memory = pc_rag.Engine(model, tok, store=MemoryStore())
        memory.warm(docs, progress=False)
        want = memory.next_token_logits(p, "modular")
        writer = pc_rag.Engine(model, tok, store=[f"disk:{folder}"])
        writer.warm(docs, progress=False)
        reader = pc_rag.Engine(model, tok, store=["memory", f"disk:{folder}"])
        gen = reader.generate(p, mode="modular", max_new_tokens=1)
        got = reader.next_token_logits(p, "modular")
        origins = sorted({s.origin for s in gen.sources if s.kind == "chunk"})
        keys = reader.planner.chunk_keys([s for s in reader.segmenter.segments(p) if s.kind == "chunk"])
        promoted = [reader.store.tiers[0].get(k) for k in keys]
        devices = sorted({b.keys.device.type for b in promoted if b is not None})
        e = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        ok = e <= tol and "disk" in origins and devices == [model.device.type]
        return Row(name, "disk -> device", ok, f"chunks from {origins}, promoted blocks on {devices}, "
                                               f"modular vs memory rel diff {e:.1e}")


def batch_row(name, model, tok, prompts, check: str = "batched decode") -> Row:
    serial = pc_rag.testing.one_at_a_time(pc_rag.Engine(model, tok, store=MemoryStore()))
    alone = [serial.generate(p, mode="full", max_new_tokens=24).token_ids for p in prompts]
    batched = pc_rag.Engine(model, tok, store=MemoryStore())
    got = [None] * len(prompts)

    def run(i):
        got[i] = batched.generate(prompts[i], mode="full", max_new_tokens=24).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    decode = batched.stats()["decode"]
    ok = got == alone and (check == "batched decode" or decode["first_tokens"] > 0)
    return Row(name, check, ok,
               f"{len(prompts)} concurrent requests x 24 tokens, largest batch {decode['max_batch_seen']}, "
               f"prompts computed by the shared step {decode['first_tokens']} ({decode['prompt_tokens']} tokens), "
               f"equal to one at a time: {got == alone}")


def ttft_row(name, engine, prompt, ids_of, docs) -> Row:
    model, dev = engine.model, engine.runner.device
    order = list(range(len(docs)))
    p = prompt(order)
    n = len(ids_of(p))
    x = torch.tensor([ids_of(p)], device=dev)

    def timed(fn) -> float:
        fn()  # warm-up (kernels, allocator, the cached blocks)
        times = []
        for _ in range(3):
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    with torch.inference_mode():
        hf = timed(lambda: model(input_ids=x).logits[0, -1].float())
    full = timed(lambda: engine.next_token_logits(p, "full"))
    engine.generate(prompt(order, "An earlier question?"), mode="exact", max_new_tokens=1)
    exact = timed(lambda: engine.next_token_logits(prompt(order, "Another question?"), "exact"))
    engine.warm(docs, progress=False)
    modular = timed(lambda: engine.next_token_logits(prompt(order[::-1]), "modular"))
    return Row(name, f"TTFT {n} tokens", None,
               f"HF prefill {hf:.0f} ms; pc_rag full {full:.0f} ms, exact {exact:.0f} ms, modular {modular:.0f} ms")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_table(rows: list[Row], device: torch.device, dtype: torch.dtype, seconds: float) -> None:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"pc_rag GPU check on {where} ({dtype}), torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {seconds:.0f} s\n")
    print("| model | check | result | detail |\n|---|---|---|---|")
    for r in rows:
        result = "measured" if r.ok is None else ("pass" if r.ok else "FAIL")
        print(f"| {r.model} | {r.check} | {result} | {r.detail} |")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
