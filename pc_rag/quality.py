"""What pc_rag measures of a model's approximation before relying on it: the scale a quality target is read against.

A reused chunk's keys deviate from keys computed in context by an amount that depends on the model (its depth,
its attention) as much as on the prompt. `deviation_reference` measures, once per engine, the mean relative key
deviation (at layer 1, as blend's probe measures it) of chunks placed after unrelated ones, on built-in text
(Python's own documentation), so that a quality target means the same share of that deviation on every model
(`assemble.Recompute.target`): a prompt whose chunks deviate less than the reference, because they need little of
what precedes them, is left as modular left it, and one whose chunks deviate more gets more recomputed.

`calibrate_ape` chooses APE's temperature and scale per model (align.py): the pair of a grid closest to full's next
token, by mean KL, on the user's prompts or the gate's built-in ones.

`calibrate` is the gate per model (`Engine.min_agreement`, off by default): on built-in prompts (chunks of the
same documentation in several orders, each after unrelated ones) it relates each prompt's deviation to whether
modular's next token is full's, once per engine, before its first modular or blend request. When modular agrees
with full on fewer of them than the engine's bound, modular is refused on this model (UnsupportedModelError
naming the figures) and blend stays allowed: the user chose to pay for recomputation there. It is off by default
because it costs two prefills per built-in prompt at first use (seconds on a 7B model on a CPU) and because its
prompts are English prose: a model trained for something else (the retrieval testbeds) is not judged by it;
`pc-rag check` measures the user's own documents and questions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import align
from .align import APE, SCALES, TEMPERATURES
from .errors import PromptError, UnsupportedModelError
from .segments import Chunk, Text

log = logging.getLogger(__name__)

REFERENCE_CHUNKS = 3
REFERENCE_CHARS = 600
CALIBRATION_TOPICS = (5, 40, 75, 32, 48, 64)  # pydoc topics: 8 prompts of 3 of these in different orders
CALIBRATION_ORDERS = ((0, 1, 2), (2, 0, 1), (3, 4, 5), (5, 3, 4), (1, 3, 5), (4, 2, 0), (2, 5, 1), (0, 4, 3))
CALIBRATION_QUESTIONS = ("Question: what do these describe?\nAnswer:", "Question: which one is about syntax?\nAnswer:")


@dataclass(frozen=True)
class CalibrationPrompt:
    deviation: float  # blend's probe: mean relative key deviation of the reused chunk tokens at layer 1
    agrees: bool  # modular's most likely next token is full's
    kl: float  # KL(full || modular) of the next-token distribution, nats


@dataclass(frozen=True)
class Calibration:
    """The gate's measurement on built-in prompts (`calibrate`)."""

    prompts: tuple[CalibrationPrompt, ...]

    @property
    def agreement(self) -> float:
        return sum(p.agrees for p in self.prompts) / len(self.prompts)

    @property
    def kl(self) -> float:
        return sum(p.kl for p in self.prompts) / len(self.prompts)

    @property
    def deviation(self) -> float:
        return sum(p.deviation for p in self.prompts) / len(self.prompts)

    def as_dict(self) -> dict:
        """For `Engine.stats()`: the figures, and the mean deviation of the prompts where modular agreed and of
        those where it did not (how the deviation blend measures relates to agreement on this model)."""
        def mean(xs):
            xs = list(xs)
            return sum(xs) / len(xs) if xs else None

        return {"prompts": len(self.prompts), "agreement": self.agreement, "kl": self.kl,
                "deviation": self.deviation,
                "deviation_agreeing": mean(p.deviation for p in self.prompts if p.agrees),
                "deviation_differing": mean(p.deviation for p in self.prompts if not p.agrees)}

_lock = threading.Lock()


def reference_prompt(chars: int = REFERENCE_CHARS, topics_at=(5, 40, 75),
                     question: str = CALIBRATION_QUESTIONS[0]) -> list[Text | Chunk]:
    """Unrelated chunks of Python's documentation (`chars` characters each) after a short instruction, and a
    question."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    chunks = [" ".join(topics[keys[i]].split())[:chars] for i in topics_at][:REFERENCE_CHUNKS]
    parts: list[Text | Chunk] = [Text("Answer from the documents below.\n\n")]
    for c in chunks:
        parts += [Chunk(c), Text("\n\n")]
    return [*parts, Text(question)]


def calibration_prompts(chars: int = REFERENCE_CHARS) -> list[list[Text | Chunk]]:
    """The gate's built-in prompts: the same documentation chunks in several orders, each after unrelated ones."""
    return [reference_prompt(chars, [CALIBRATION_TOPICS[j] for j in order],
                             CALIBRATION_QUESTIONS[i % len(CALIBRATION_QUESTIONS)])
            for i, order in enumerate(CALIBRATION_ORDERS)]


def _fitting(engine, build):
    """The segments of `build(chars)`, with shorter chunks for a model whose context the prompt would not fit."""
    from .request import prompt_segments

    chars = REFERENCE_CHARS
    while True:
        try:
            return prompt_segments(engine, build(chars), "blend")[0]
        except PromptError:
            if chars <= 16:
                raise
            chars //= 2


def _own_assembler(engine):
    """A planner and assembler over a store of their own: nothing measured here is kept in the engine's store."""
    from .assemble import Assembler
    from .plan import Planner
    from .store import MemoryStore

    planner = Planner(engine.planner.fingerprint, engine.planner.sink_ids, rope_type=engine.runner.rope_type,
                      relocatable=engine.runner.relocatable)
    return planner, Assembler(engine.runner, MemoryStore(), planner)


def _stored(planner, assembler, segments) -> None:
    """Each chunk's (and passage's) own encoding stored first, as a warm cache holds it."""
    for seg in segments:
        if seg.kind in ("chunk", "passage"):
            assembler.ensure_stored(planner.chunk_wanted(seg))


def _assembled(engine, planner, assembler, segments, mode: str, recompute=None, align: APE | None = None):
    """The prompt assembled in `mode` (its cache released at once): the logits and what blend's probe measured."""
    lookups = assembler.lookups()
    asm = assembler.assemble(planner.plan(segments, mode, lookups, align=align), lookups.blocks, 0, recompute)
    engine.runner.release_cache(asm.cache)
    return asm


def _full(engine, planner, assembler, segments):
    """Full's assembly: blend recomputing every chunk token (full up to float rounding)."""
    from .assemble import Recompute

    return _assembled(engine, planner, assembler, segments, "blend", Recompute(1.0, "deviation"))


def _kl(logp_full: torch.Tensor, logp: torch.Tensor) -> float:
    """KL(full || other) of two next-token log-distributions, nats."""
    return float((logp_full.exp() * (logp_full - logp)).sum())


def _measure(engine, planner, assembler, segments) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Full's next-token logits, modular's, and the deviation blend's probe measured."""
    _stored(planner, assembler, segments)
    full = _full(engine, planner, assembler, segments)
    modular = _assembled(engine, planner, assembler, segments, "modular")
    return full.logits.float(), modular.logits.float(), max(full.deviation or 0.0, 1e-6)


def calibrate(engine) -> Calibration:
    """The engine's calibration (see the module docstring), measured on first use and remembered."""
    with _lock:
        if engine.calibration is None:
            planner, assembler = _own_assembler(engine)
            measured = []
            for i in range(len(CALIBRATION_ORDERS)):
                segments = _fitting(engine, lambda chars, i=i: calibration_prompts(chars)[i])
                full, modular, deviation = _measure(engine, planner, assembler, segments)
                kl = _kl(torch.log_softmax(full, -1), torch.log_softmax(modular, -1))
                measured.append(CalibrationPrompt(deviation, int(full.argmax()) == int(modular.argmax()), kl))
            engine.calibration = Calibration(tuple(measured))
        return engine.calibration


def deviation_reference(engine, select: str = "progressive") -> float:
    """The engine's reference deviation for the probe blend's `select` reads a target from (layer 1's key
    deviation; for "shift", layer 0's relative shift), measured on its first use (a prefill of `reference_prompt`
    in a store of its own, so nothing of it is kept) and remembered."""
    probe = "shift" if select == "shift" else "keys"
    with _lock:
        if probe not in engine.measured_deviation:
            from .assemble import Recompute

            planner, assembler = _own_assembler(engine)
            segments = _fitting(engine, reference_prompt)
            _stored(planner, assembler, segments)
            # keys: every token recomputed, layer 1 measured on the way; shift: target 0 reads the probe only
            recompute = Recompute(1.0, "deviation") if probe == "keys" else Recompute(0.0, "shift", 0.0)
            asm = _assembled(engine, planner, assembler, segments, "blend", recompute)
            engine.measured_deviation[probe] = max(asm.deviation or 0.0, 1e-6)
        return engine.measured_deviation[probe]


def gate(engine, mode: str) -> None:
    """The gate per model (`Engine.min_agreement`): refuse modular on a model whose modular agreed with full on
    fewer of the built-in prompts than the bound (`calibrate`). Blend stays allowed: it recomputes."""
    if engine.min_agreement is None or mode not in ("modular", "blend"):
        return
    cal = calibrate(engine)
    if mode == "modular" and cal.agreement < engine.min_agreement:
        raise UnsupportedModelError(
            f"modular refused on this model: its next token agreed with full's on {cal.agreement:.2f} of "
            f"{len(cal.prompts)} built-in prompts (mean KL {cal.kl:.3g} nats), below engine.min_agreement = "
            f"{engine.min_agreement:g}; use blend (recompute_target=0.9), exact or full, or measure your own "
            f"documents with `pc-rag check`")


# The least drop in mean KL(full || APE) below modular's for calibration to choose a pair over T = S = 1. On the
# 8-layer retrieval testbed the KL-best pair (T 1, S 0.3) was 3% below modular's and lost 1.7 points of accuracy on
# one row (2,000 prompts; docs/results.md, "APE on the deeper testbed"): a gain that small moves the argmax of
# borderline prompts more than it moves the distribution, so it is not taken.
APE_MIN_KL_GAIN = 0.10


def calibrate_ape(engine, prompts=None, temperatures: Sequence[float] = TEMPERATURES,
                  scales: Sequence[float] = SCALES) -> tuple[APE, dict]:
    """Choose T and S for the engine's model: on `prompts` (default: the quality gate's built-in prompts,
    quality.calibration_prompts), the pair of the grid whose next-token distribution (modular with APE) is closest
    to full's, by mean KL(full || APE), if it earns its place: its KL at least APE_MIN_KL_GAIN below modular's
    (T = S = 1, always measured) and its top-1 agreement with full not below modular's; otherwise T = S = 1, so
    that APE as calibrated is modular. Measured in a store of its own (nothing kept in the engine's), remembered
    per model fingerprint (`align.CALIBRATED`), saved in `engine.calibration_dir` if set, and set as the
    engine's. Returns the pair and, per pair tried, its mean KL and top-1 agreement with full."""
    with _lock:
        planner, assembler = _own_assembler(engine)
        if prompts is None:
            built = [_fitting(engine, lambda chars, i=i: calibration_prompts(chars)[i])
                     for i in range(len(calibration_prompts()))]
        else:
            from .request import prompt_segments

            built = [prompt_segments(engine, p, "modular")[0] for p in prompts]
        fulls = []
        for segments in built:
            _stored(planner, assembler, segments)
            fulls.append(torch.log_softmax(_full(engine, planner, assembler, segments).logits.float(), -1))
        table = {}
        for t, s in [(1.0, 1.0), *((t, s) for t in temperatures for s in scales if (t, s) != (1.0, 1.0))]:
            ape = APE(t, s)
            kl = agree = 0.0
            for segments, logp_full in zip(built, fulls, strict=True):
                asm = _assembled(engine, planner, assembler, segments, "modular", align=ape)
                logp = torch.log_softmax(asm.logits.float(), -1)
                kl += _kl(logp_full, logp) / len(built)
                agree += (int(logp.argmax()) == int(logp_full.argmax())) / len(built)
            table[(t, s)] = {"kl": kl, "agreement": agree}
        best = min(table, key=lambda ts: (table[ts]["kl"], abs(1 - ts[0]) + abs(1 - ts[1])))
        plain = table[(1.0, 1.0)]
        if table[best]["kl"] > (1 - APE_MIN_KL_GAIN) * plain["kl"] or table[best]["agreement"] < plain["agreement"]:
            best = (1.0, 1.0)
        chosen = APE(*best)
        align.CALIBRATED[engine.planner.fingerprint] = chosen
        engine.ape = chosen
        if engine.calibration_dir is not None:
            try:
                align.save_calibration(engine.calibration_dir, engine.planner.fingerprint, chosen, table, len(built))
            except OSError as e:  # a read-only or full cache folder: the pair is still this process's
                log.warning("APE calibration not saved in %s (%s): it holds for this process only",
                            engine.calibration_dir, e)
        return chosen, table
