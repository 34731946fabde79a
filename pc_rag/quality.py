"""What pc_rag measures of a model's approximation before relying on it: the scale a quality target is read against.

A reused chunk's keys deviate from keys computed in context by an amount that depends on the model (its depth,
its attention) as much as on the prompt. `deviation_reference` measures, once per engine, the mean relative key
deviation (at layer 1, as blend's probe measures it) of chunks placed after unrelated ones, on built-in text
(Python's own documentation), so that a quality target means the same share of that deviation on every model
(`assemble.Recompute.target`): a prompt whose chunks deviate less than the reference, because they need little of
what precedes them, is left as modular left it, and one whose chunks deviate more gets more recomputed.
"""

from __future__ import annotations

import threading

from .errors import PromptError
from .segments import Chunk, Text

REFERENCE_CHUNKS = 3
REFERENCE_CHARS = 600

_lock = threading.Lock()


def reference_prompt(chars: int = REFERENCE_CHARS) -> list[Text | Chunk]:
    """Unrelated chunks of Python's documentation (`chars` characters each) after a short instruction, and a
    question."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    chunks = [" ".join(topics[keys[i]].split())[:chars] for i in (5, 40, 75)][:REFERENCE_CHUNKS]
    parts: list[Text | Chunk] = [Text("Answer from the documents below.\n\n")]
    for c in chunks:
        parts += [Chunk(c), Text("\n\n")]
    return [*parts, Text("Question: what do these describe?\nAnswer:")]


def deviation_reference(engine) -> float:
    """The engine's reference deviation, measured on its first use (a prefill of `reference_prompt` in a store
    of its own, so nothing of it is kept) and remembered."""
    with _lock:
        if engine.measured_deviation is None:
            from .assemble import Assembler, Recompute
            from .plan import Planner
            from .request import prompt_segments
            from .store import MemoryStore

            planner = Planner(engine.planner.fingerprint, engine.planner.sink_ids, rope_type=engine.runner.rope_type,
                              relocatable=engine.runner.relocatable)
            assembler = Assembler(engine.runner, MemoryStore(), planner)
            chars = REFERENCE_CHARS
            while True:  # shorter chunks for a model whose context the reference prompt would not fit
                try:
                    segments, _ = prompt_segments(engine, reference_prompt(chars), "blend")
                    break
                except PromptError:
                    if chars <= 16:
                        raise
                    chars //= 2
            for seg in segments:  # each chunk's own encoding first, as a warm cache holds it
                if seg.kind == "chunk":
                    assembler.ensure_stored(planner.chunk_wanted(seg))
            lookups = assembler.lookups()
            plan = planner.plan(segments, "blend", lookups)
            asm = assembler.assemble(plan, lookups.blocks, 0, Recompute(1.0, "deviation"))
            engine.runner.release_cache(asm.cache)
            engine.measured_deviation = max(asm.deviation or 0.0, 1e-6)
        return engine.measured_deviation
