"""Write the README's results section from the benchmark JSON files.

    python -m benchmarks.ttft --out bench_out && python -m benchmarks.fidelity --out bench_out
    python -m benchmarks.report --out bench_out

Replaces the text between the `results` markers in README.md and draws the TTFT plot into docs/ttft.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import fidelity, ttft

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
        f"{best['modular_over_ideal']:.2f}x the ideal (only the question run over a ready cache: the floor "
        "no cache can beat). Decode speed per token is unchanged by reuse.\n\n"
        + ttft.markdown(t)
        + "\n![TTFT against prompt length](docs/ttft.png)\n"
    )
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
    acc = ROOT / "benchmarks" / "retrieval-results" / "accuracy.md"
    if acc.exists():
        parts.append(
            "### Answer accuracy of a trained model\n\n"
            "A 0.6M-parameter Llama (4 layers, word-level tokenizer) trained for 36 minutes (7,800 steps) on this CPU "
            "(`benchmarks/train_retrieval.py`) on synthetic retrieval: single hop (`417 is the code of Bako .` "
            "among distractor chunks) and two hop (`Raso works with Dimu .` in one chunk, Raso's code in "
            "another). It is still under-trained: full-mode accuracy falls with the number of chunks, and two "
            "hop is learned only for few chunks, so accuracy differences between modes are mostly within "
            "noise (200 prompts: about ±3 points); the agreement with full (in brackets) is the clearer "
            "signal.\n\n" + acc.read_text()
            + "\nReproduce: `python -m benchmarks.train_retrieval --out benchmarks/retrieval-model --threads 2 "
            "--max-steps 7800 --max-minutes 1000 && python -m benchmarks.accuracy --model "
            "benchmarks/retrieval-model --prompts 200 --chunks 2 3 4 6 --out benchmarks/retrieval-results`.\n"
        )
    parts.append(
        "Reproduce the rest: `python benchmarks/ttft.py --lengths 1024 2048 4096 8192 --reps 5 --out bench_out && "
        "python -m benchmarks.fidelity --prompts 8 --out bench_out && python -m benchmarks.report --out bench_out` "
        "(`pc-rag bench` runs the first)."
    )
    return "\n".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    readme = ROOT / "README.md"
    text = readme.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    readme.write_text(text[:a] + "\n" + section(out) + "\n" + text[b:])
    ttft.plot(json.loads((out / "ttft.json").read_text()), ROOT / "docs" / "ttft.png")
    print(f"updated {readme}")


if __name__ == "__main__":
    main()
