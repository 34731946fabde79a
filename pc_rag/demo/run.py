"""The demo's run: RAG over Python's own documentation, TTFT per mode, and the KV cache surviving a restart.

For each question: FAISS finds the top-k chunks (all-MiniLM-L6-v2 embeddings), the prompt is
[Text(system), Chunk, Text("\\n\\n"), Chunk, ..., Text(question)], and it is answered in every mode (full,
exact, modular) on one engine whose store is memory over a disk folder. A second run in a new process finds
the chunks' KV on disk. With no `--model`, the model is the offline "bench" Llama built once into the cache
folder: its weights are random, so its words mean nothing, while the token counts, timings and cache hits
are real.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..segments import Chunk, Text

SYSTEM = "You answer questions about Python using only the documentation excerpts below.\n\n"
# Pairs on one subject, so later questions retrieve some chunks an earlier one used (in another order).
QUESTIONS = (
    "How do I leave a for loop early, and when does the loop's else clause run?",
    "What does the break statement do inside a while loop with an else branch?",
    "How do I catch an exception and clean up with finally?",
    "What happens to an exception raised inside a try statement that has a finally clause?",
    "How do I define a function with default argument values?",
    "How are keyword arguments matched to parameters when a function is called?",
)
# In this order on one store: modular first, so its row shows chunk reuse rather than a prefix that an exact
# request of the same prompt has just stored.
MODES = ("full", "modular", "exact")


@dataclass(frozen=True)
class DemoRow:
    question: int  # 1-based index into the questions asked
    mode: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    served: dict[str, int]  # tokens by where their KV came from: "memory", "disk", ..., "computed", "fresh"
    answer: str


@dataclass
class DemoReport:
    model: str
    cache_dir: str
    random_weights: bool
    chunks: int
    questions: list[str]
    rows: list[DemoRow] = field(default_factory=list)
    store: dict = field(default_factory=dict)  # lookups, found (hits), hit_rate, per-tier hits/misses of this run

    def median_ttft_s(self, mode: str) -> float:
        return statistics.median(r.ttft_s for r in self.rows if r.mode == mode)

    def to_json(self) -> str:
        out = asdict(self)
        out["median_ttft_s"] = {m: self.median_ttft_s(m) for m in MODES if any(r.mode == m for r in self.rows)}
        return json.dumps(out, indent=2)


def demo_model(cache_dir: Path, progress: bool = True) -> Path:
    """The offline bench Llama in `<cache_dir>/models/bench`, built on first use (random weights)."""
    from ..testing import build_tiny_llama

    path = cache_dir / "models" / "bench"
    if (path / "pc_rag_test_model.json").is_file():  # written last by build_tiny_llama: the build finished
        return path
    if progress:
        print(f"Building the offline demo model (random weights) in {path} ...", file=sys.stderr)
    tmp = path.with_name(f".bench.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_llama(tmp, size="bench")
    try:
        os.replace(tmp, path)  # atomic; if another process finished first, keep its copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_prompt(chunks: Sequence[str], question: str) -> list[Text | Chunk]:
    parts: list[Text | Chunk] = [Text(SYSTEM)]
    for i, c in enumerate(chunks):
        if i:
            parts.append(Text("\n\n"))
        parts.append(Chunk(c))
    parts.append(Text(f"\n\nQuestion: {question}\nAnswer:"))
    return parts


def _served(generation) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for s in generation.sources:
        counts[s.origin or "fresh"] += s.tokens
    return dict(counts)


def _lookup_counts(engine) -> dict[str, tuple[int, int]]:
    return {t["name"]: (t["hits"], t["misses"]) for t in engine.stats()["tiers"]}


def run_demo(engine, index, questions: Sequence[str], k: int = 4, max_new_tokens: int = 16,
             modes: Sequence[str] = MODES, model_name: str = "", cache_dir: str = "",
             random_weights: bool = False) -> DemoReport:
    """Answer every question in every mode; the report holds one row per (question, mode)."""
    report = DemoReport(model_name, cache_dir, random_weights, len(index.chunks), list(questions))
    prompts = [build_prompt([c for c, _ in index.search(q, k)], q) for q in questions]
    # One untimed full forward of a real prompt first (full mode neither reads nor writes the store): the first
    # call in a process pays for allocator and kernel set-up.
    engine.next_token_logits(prompts[0], mode="full")
    before = _lookup_counts(engine)
    for qi, prompt in enumerate(prompts, 1):
        for mode in modes:
            g = engine.generate(prompt, mode=mode, max_new_tokens=max_new_tokens)
            report.rows.append(DemoRow(qi, mode, g.ttft_s, g.prompt_tokens, g.cached_tokens, g.computed_tokens,
                                       _served(g), g.text))
    after = _lookup_counts(engine)
    tiers = {name: {"hits": h - before.get(name, (0, 0))[0], "misses": m - before.get(name, (0, 0))[1]}
             for name, (h, m) in after.items()}
    top = next(iter(tiers.values()), {"hits": 0, "misses": 0})
    lookups = top["hits"] + top["misses"]  # every block is asked of the top tier first
    # Found: not missed by the last tier, and at least the top tier's hits. (Not the sum of the tiers' hits: the disk
    # and Redis tiers answer a run of 8 prefix blocks that memory missed with one entry, an extent; and they are
    # also asked for extents memory never holds, whose misses the last tier counts.)
    missed = list(tiers.values())[-1]["misses"] if tiers else 0
    hits = max(top["hits"], lookups - missed)
    report.store = {"lookups": lookups, "hits": hits, "hit_rate": hits / lookups if lookups else 0.0,
                    "tiers": tiers}
    return report


def format_report(report: DemoReport) -> str:
    lines = [f"model: {report.model}", f"cache: {report.cache_dir}", f"corpus: {report.chunks} chunks "
             "of Python's documentation topics (pydoc_data), FAISS top-k by all-MiniLM-L6-v2", ""]
    if report.random_weights:
        lines += ["NOTE: the demo model's weights are random, so its answers are meaningless words. Everything",
                  "else is real: retrieval, tokens, the cached KV, the timings and the store hits.", ""]
    for i, q in enumerate(report.questions, 1):
        lines.append(f"Q{i}: {q}")
    lines += ["", "Each question runs in full, modular, then exact mode on one store (a request may reuse what an",
              "earlier one stored). cached = prompt tokens whose KV came from the store; computed = encoded now.", ""]
    header = f"{'Q':>3}  {'mode':<8} {'TTFT ms':>9} {'prompt':>7} {'cached':>7} {'computed':>9}  KV served from"
    lines += [header, "-" * (len(header) + 12)]
    for r in report.rows:
        served = ", ".join(f"{k} {v}" for k, v in sorted(r.served.items(), key=lambda kv: -kv[1]))
        lines.append(f"{r.question:>3}  {r.mode:<8} {r.ttft_s * 1000:>9.1f} {r.prompt_tokens:>7} "
                     f"{r.cached_tokens:>7} {r.computed_tokens:>9}  {served}")
    lines.append("")
    modes = [m for m in MODES if any(r.mode == m for r in report.rows)]
    if "full" in modes:
        base = report.median_ttft_s("full")
        lines.append("median TTFT: " + "; ".join(
            f"{m} {report.median_ttft_s(m) * 1000:.1f} ms ({base / report.median_ttft_s(m):.1f}x vs full)"
            for m in modes))
    cached = sum(r.cached_tokens for r in report.rows if r.mode != "full")
    prompt = sum(r.prompt_tokens for r in report.rows if r.mode != "full")
    lines.append(f"exact+modular: {cached} of {prompt} prompt tokens came from the cache")
    s = report.store
    per_tier = ", ".join(f"{name} {t['hits']}/{t['hits'] + t['misses']}" for name, t in s["tiers"].items())
    lines.append(f"store hit rate: {s['hits']}/{s['lookups']} lookups = {s['hit_rate']:.0%} (hits per tier: "
                 f"{per_tier})")
    if s["tiers"].get("disk", {}).get("hits"):
        lines.append("disk hits: KV written by an earlier process was reused after a restart.")
    else:
        lines.append("Run the same command again: a new process will find these chunks' KV on disk.")
    return "\n".join(lines)

