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
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id)
        self.prepare_s = time.perf_counter() - t0
        self.vocab = len(tok)
        self.words = (self.vocab + 31) // 32
        self.bits = torch.arange(32, dtype=torch.int32)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = self.ll.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar, m

    def matcher(self, compiled):
        return compiled[1].deep_copy()

    def step(self, m, logits, bitmask, row):
        m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), self.words * 4)
        allowed = ((bitmask[row, :, None] >> self.bits) & 1).view(-1)[: self.vocab].bool()
        logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, m, token):
        assert m.consume_token(token), m.get_error()

    def fill_parallel(self, matchers, bitmask):
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              self.words * 4, len(matchers))

    def bitmask(self, rows):
        return torch.full((rows, self.words), -1, dtype=torch.int32)


class XGrammar:
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

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, m, logits, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)
        self.xgr.apply_token_bitmask_inplace(logits[None], bitmask[row: row + 1])

    def accept(self, m, token):
        assert m.accept_token(token)

    fill_parallel = None

    def bitmask(self, rows):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)


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
    for rows in rows_list:
        matchers = [b.matcher(compiled) for _ in range(rows)]
        bitmask = b.bitmask(rows)
        step_times, fill_times = [], []
        for token in ids:
            t0 = time.perf_counter()
            for r, m in enumerate(matchers):
                row = logits.clone()
                b.step(m, row, bitmask, r)
                if not torch.isfinite(row[token]):
                    raise AssertionError(f"{b.name}: token {token} of the valid output masked")
            step_times.append(time.perf_counter() - t0)
            if b.fill_parallel is not None and rows > 1:
                t0 = time.perf_counter()
                b.fill_parallel(matchers, bitmask)
                fill_times.append(time.perf_counter() - t0)
            for m in matchers:
                b.accept(m, token)
        out[f"step_ms_{rows}"] = median_ms(step_times)
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
    results = {}
    for vocab in (8192, 128256):
        tok = hf_tokenizer(vocab)
        for cls in (LLGuidance, XGrammar):
            try:
                results[(cls.name, vocab)] = measure(cls, tok, args.reps, rows_list)
            except ImportError:
                results[(cls.name, vocab)] = None
    sizes = install_sizes() if args.install_size else {}
    head = ["backend", "vocab", "tokenizer prep s", "compile ms"] + [f"step ms, {r} row{'s' * (r > 1)}"
                                                                      for r in rows_list]
    head += [f"parallel fill ms, {r} rows" for r in rows_list if r > 1]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (name, vocab), r in results.items():
        if r is None:
            print(f"| {name} | {vocab} | not installed |")
            continue
        cells = [name, str(vocab), f"{r['prepare_s']:.2f}", f"{r['compile_ms']:.2f}"]
        cells += [f"{r[f'step_ms_{n}']:.3f}" for n in rows_list]
        cells += [f"{r[f'fill_par_ms_{n}']:.3f}" if f"fill_par_ms_{n}" in r else "-" for n in rows_list if n > 1]
        print("| " + " | ".join(cells) + " |")
    for name, s in sizes.items():
        print(f"\n{name}: adds {s['mb']:.0f} MB to a virtualenv with torch and transformers")
    return results, sizes


if __name__ == "__main__":
    main()
