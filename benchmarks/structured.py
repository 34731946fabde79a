"""Constrained decoding backends side by side: llguidance (pc_rag's, a core dependency) and xgrammar (the one pc_rag
used before). Prints one table.

    python -m benchmarks.structured [--reps 50] [--rows 1,8,32] [--install-size]

Per backend:
- install size: what `pip install <backend>` adds to a fresh virtualenv that already holds pc_rag's own
  dependencies (torch 2.13.0 CPU, transformers: xgrammar requires both), in MB on disk (`--install-size`: builds two
  virtualenvs, a few minutes);
- compile: one JSON schema (a tool call's arguments: strings, an enum, bounded integers, an array) compiled for the
  tokenizer, median of `--reps` fresh compilations (each backend's own cache off or bypassed); the tokenizer's own
  preparation (once per engine) is reported apart;
- mask: one decode step of one request, the mask computed for the next token and applied to a float32 logits row,
  median over the steps of a fixed valid output (so both backends walk the same states); at the bench vocabulary
  (8K, pc_rag.testing) and at 128K (the bench tokenizer grown to Llama 3's vocabulary size with merges of its own
  tokens: real BPE, more and longer tokens);
- rows: the same for R requests in one batched decode step (R matchers, one mask each, applied row by row as
  pc_rag's sampler does; llguidance's parallel fill as well, which pc_rag's per-row sampler does not use).

Timings are wall-clock on whatever machine runs this; on the shared 2-core CPU they are noisy (say so with them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import pc_rag.testing as testing
from pc_rag.model import heap

SCHEMA = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit", "kelvin"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "strict": {"type": "boolean"},
    },
    "required": ["query", "unit", "days", "tags", "strict"],
    "additionalProperties": False,
}
# A valid output both backends walk step by step (`json.dumps`'s separators, no free whitespace: how pc_rag compiles
# schemas).
OUTPUT = json.dumps({"query": "decorators in python classes", "unit": "celsius", "days": 7,
                     "tags": ["python", "docs", "classes"], "strict": True})

BACKENDS = {"llguidance": "llguidance==1.9.1", "xgrammar": "xgrammar==0.2.9"}


# ---- tokenizers ---------------------------------------------------------------------------------------------------
def hf_tokenizer(vocab_size: int):
    """The bench tokenizer (8K), or it grown to `vocab_size` by BPE merges of pairs of its own tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    base = json.loads(testing._trained_tokenizer(8192))
    model = base["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = list(model["merges"])
    if vocab_size > len(vocab):
        specials = {t["content"] for t in base["added_tokens"]}  # ids 0.. (the trainer puts them first): kept
        words = [w for w in sorted(vocab, key=vocab.get) if w not in specials]
        rng = random.Random(0)
        next_id = max(vocab.values()) + 1
        while len(vocab) < vocab_size:
            a, b = rng.choice(words), rng.choice(words)
            if a + b in vocab:
                continue
            vocab[a + b] = next_id
            next_id += 1
            merges.append([a, b] if isinstance(merges[0], list) else f"{a} {b}")
    model["merges"] = merges
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(base)), bos_token=testing.BOS,
                                  eos_token=testing.EOS)
    return tok


# ---- backends -----------------------------------------------------------------------------------------------------
class LLGuidance:
    """pc_rag's own grammar code (pc_rag.grammar), which runs on llguidance."""

    name = "llguidance"

    def __init__(self, tok):
        import llguidance

        from pc_rag.grammar import Grammars

        self.grammars = Grammars(tok, len(tok), [tok.eos_token_id])
        t0 = time.perf_counter()
        self.tokenizer = self.grammars._tokenizer_now()
        self.prepare_s = time.perf_counter() - t0
        self.vocab = len(tok)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        from pc_rag.grammar import Grammar, Grammars

        return Grammars._compile(self.tokenizer, Grammar.json_schema(schema))  # not the engine's cache

    def state(self, compiled):
        from pc_rag.grammar import GrammarState

        return GrammarState(compiled.deep_copy(), self.vocab, None)

    def step(self, state, logits):
        return state.mask(logits)

    def accept(self, state, token):
        state.accept(token)

    def fill_parallel(self, states, bitmask):
        self.executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, len(states))

    def bitmask(self, rows):
        return torch.zeros((rows, (self.vocab + 31) // 32), dtype=torch.int32)


class XGrammar:
    """xgrammar as pc_rag ran it before (the `structured` extra): the same steps with its matcher and kernels."""

    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.prepare_s = time.perf_counter() - t0
        self.vocab = len(tok)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def state(self, compiled):
        return self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab)

    def step(self, state, logits):
        matcher, bitmask = state
        out = logits.detach().to("cpu", torch.float32, copy=True)
        matcher.fill_next_token_bitmask(bitmask)
        self.xgr.apply_token_bitmask_inplace(out[None], bitmask)
        return out

    def accept(self, state, token):
        assert state[0].accept_token(token)

    fill_parallel = None


# ---- measurements -------------------------------------------------------------------------------------------------
def median_ms(times):
    return 1e3 * statistics.median(times)


def measure(backend_cls, tok, reps: int, rows_list) -> dict:
    b = backend_cls(tok)
    out = {"prepare_s": b.prepare_s}
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        compiled = b.compile(SCHEMA)
        times.append(time.perf_counter() - t0)
    out["compile_ms"] = median_ms(times)
    ids = tok(OUTPUT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    logits = torch.randn(b.vocab)
    # The first request over a freshly compiled grammar (whatever a backend builds lazily, it builds here).
    compiled = b.compile(SCHEMA)
    state = b.state(compiled)
    t0 = time.perf_counter()
    for token in ids:
        b.step(state, logits)
        b.accept(state, token)
    out["first_request_ms"] = 1e3 * (time.perf_counter() - t0)
    out["tokens"] = len(ids)
    for rows in rows_list:
        states = [b.state(compiled) for _ in range(rows)]
        bitmask = b.bitmask(rows) if b.fill_parallel is not None else None
        step_times, fill_times = [], []
        for token in ids:
            t0 = time.perf_counter()
            for st in states:
                row = b.step(st, logits)
                if not torch.isfinite(row[token]):
                    raise AssertionError(f"{b.name}: token {token} of the valid output masked")
            step_times.append(time.perf_counter() - t0)
            if bitmask is not None and rows > 1:
                t0 = time.perf_counter()
                b.fill_parallel(states, bitmask)
                fill_times.append(time.perf_counter() - t0)
            for st in states:
                b.accept(st, token)
        out[f"step_ms_{rows}"] = median_ms(step_times)
        out[f"step_max_ms_{rows}"] = 1e3 * max(step_times)
        if fill_times:
            out[f"fill_par_ms_{rows}"] = median_ms(fill_times)
    return out


def install_sizes() -> dict:
    """MB each backend adds to a fresh virtualenv holding pc_rag's dependencies (torch 2.13.0 CPU, transformers)."""
    sizes = {}
    with tempfile.TemporaryDirectory() as root:
        for name, requirement in BACKENDS.items():
            env = Path(root) / name
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
            pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q"]
            subprocess.run(pip + ["torch==2.13.0", "transformers>=5.23,<5.25"], check=True)
            before = _du(env)
            subprocess.run(pip + [requirement], check=True)
            added = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                                   capture_output=True, text=True, check=True).stdout
            sizes[name] = {"mb": (_du(env) - before) / 1e6, "packages": added}
    return sizes


def results_tokens(results) -> int:
    return next((r["tokens"] for r in results.values() if r), 0)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--install-size", action="store_true")
    args = ap.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    heap.keep_temporaries()  # as an engine on the CPU does: a step's temporaries reused, not mapped afresh
    results = {}
    for vocab in (8192, 128256):
        tok = hf_tokenizer(vocab)
        for cls in (LLGuidance, XGrammar):
            try:
                results[(cls.name, vocab)] = measure(cls, tok, args.reps, rows_list)
            except ImportError:
                results[(cls.name, vocab)] = None
    sizes = install_sizes() if args.install_size else {}
    head = ["backend", "vocab", "tokenizer prep s", "compile ms", "1st request ms"]
    head += [f"step ms, {r} row{'s' * (r > 1)} (max)" for r in rows_list]
    head += [f"llguidance parallel fill ms, {r} rows" for r in rows_list if r > 1]
    print(f"JSON schema of {len(SCHEMA['properties'])} properties; a {results_tokens(results)}-token output; "
          "medians over its steps")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (name, vocab), r in results.items():
        if r is None:
            print(f"| {name} | {vocab} | not installed |")
            continue
        cells = [name, str(vocab), f"{r['prepare_s']:.2f}", f"{r['compile_ms']:.2f}", f"{r['first_request_ms']:.1f}"]
        cells += [f"{r[f'step_ms_{n}']:.3f} ({r[f'step_max_ms_{n}']:.1f})" for n in rows_list]
        cells += [f"{r[f'fill_par_ms_{n}']:.3f}" if f"fill_par_ms_{n}" in r else "-" for n in rows_list if n > 1]
        print("| " + " | ".join(cells) + " |")
    for name, s in sizes.items():
        print(f"\n{name}: adds {s['mb']:.0f} MB to a virtualenv with torch 2.13.0 (CPU) and transformers")
    return results, sizes


if __name__ == "__main__":
    main()
