"""What each reusing mode costs in answers and saves in time, on your model and your prompts (`pc-rag check`).

    report = check(engine, prompts, modes=("exact", "modular", "blend:0.2:progressive"), target=0.9)
    print(report)                      # a table; report.as_dict() for JSON; report.cheapest: a mode name or None

Every prompt is answered greedily in `full` (the reference: no reuse), then each mode is compared with it:
- agreement: the share of prompts whose greedy answer (up to `max_new_tokens`) is token for token full's;
- first divergence: over the prompts that differ, the mean index of the first answer token that differs;
- KL: the mean next-token KL(full || mode), in nats, over full's answer tokens, teacher-forced: the mode is given
  the prompt followed by full's first j answer tokens and its next-token distribution is compared with full's
  after the same tokens, for every j (and the end of the answer where full stopped). The same calls give
  agreement and divergence: a greedy answer equals full's exactly when the mode's most likely token after each of
  full's prefixes is full's next token (up to float rounding of near ties);
- TTFT: the median time to the first token of the mode's first request for the prompt (`Generation.ttft_s`);
- recomputed and reused tokens of that request (`Generation.recomputed_tokens`, `cached_tokens`).
Then the cheapest mode (lowest median TTFT) whose agreement reaches `target`, or None.

How it is measured, so that each mode is seen as a user sees it:
- Warm documents: before the first measured request every document is encoded and stored: chunks by
  `engine.warm`, the passages of plain-string prompts (pc_rag.passages) by requests made of those passages alone
  (in order of first appearance, with the tokens they have in their prompts). So the first request of
  a prompt in a mode reuses its documents and computes its own question, as a new question over documents seen
  before; the request that first encodes a document is not what its repeats look like. One untimed full forward
  sets up the process first.
- Order: per prompt, full first (it reads and writes nothing), then the modes as given, `exact` last: exact stores
  the prompt's exact prefix, which modular and blend would otherwise reuse instead of its documents (then they
  would equal exact). A mode's own later requests for the prompt (the teacher-forced ones) continue what its first
  stored, as a repeat would.
- Full's reference distributions come from one forward of the model over the prompt and full's answer (HF
  transformers, the model pc_rag runs): `full` equals it to 1e-4 (tests/test_models.py), and the report counts
  where its most likely token is not the answer full generated (`reference_mismatches`: near ties).
- Cost: per prompt, one full generation and one forward, then per mode one request per answer token. Those
  requests are cheap in `modular` and `exact` (each continues the blocks the previous one stored) and cost a blend
  prefill each in `blend` (blend reuses nothing past the first chunk), so blend settings dominate the run.

What it cannot tell: a different answer that means the same (other words, another order) counts as a
disagreement, and an answer identical to full's is not thereby right (full may be wrong too); KL says how far the
next-token distributions moved, not whether the meaning changed. With n prompts the agreement is known to about
+-1/sqrt(n) (the report gives a 95% interval). Explicit positions (PML) are not supported: the reference forward
lays the prompt out contiguously.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from .errors import PCRagError, UnsupportedModelError
from .segments import Chunk, Text

DEFAULT_MODES = ("exact", "modular", "blend:0.2:progressive", "blend:0.2:chunk_start")
SELECTIONS = ("progressive", "deviation", "chunk_start")
CANNOT_TELL = ("Agreement is token for token: a different answer that means the same counts as a disagreement, "
               "and an answer identical to full's is not thereby right (full may be wrong too). KL measures how far "
               "the next-token distributions moved along full's answer, not whether the meaning changed.")
WARM_GROUP_TOKENS = 2048  # passages sent per warm-up request (bounded by the model's context too)


@dataclass(frozen=True)
class Setting:
    """A mode to compare with full: "exact", "modular", or "blend" at a recompute ratio with a selection, or
    blend with a quality target (`recompute_target`: it recomputes what each prompt needs, "auto"); modular, blend
    and auto with APE too (`align` "ape": pc_rag/align.py)."""

    mode: str
    recompute_ratio: float | None = None
    selection: str | None = None
    recompute_target: float | None = None
    align: str | None = None

    @property
    def name(self) -> str:
        ape = " ape" if self.align else ""
        if self.recompute_target is not None:
            return f"auto {self.recompute_target:g}{ape}"
        return (f"blend {self.recompute_ratio:g} {self.selection}" if self.mode == "blend" else self.mode) + ape

    @classmethod
    def parse(cls, spec: str | Setting) -> Setting:
        """"exact", "modular", "blend" (ratio 0.2, progressive), "blend:RATIO", "blend:RATIO:SELECTION", or
        "auto:TARGET" (blend with recompute_target TARGET, default 0.9, progressive); any but exact followed by
        ":ape" (APE's alignment, the engine's pair), and "ape" alone for "modular:ape"."""
        if isinstance(spec, Setting):
            return spec
        if not isinstance(spec, str):
            raise PCRagError(f"check: a mode is a string such as 'modular' or 'blend:0.2:progressive', got "
                             f"{type(spec).__name__}")
        text = spec.strip()
        if text == "ape":
            text = "modular:ape"
        if text.endswith(":ape"):
            base = cls.parse(text[: -len(":ape")])
            if base.mode == "exact" or base.align:
                raise PCRagError(f"check: {spec!r}: APE aligns attention over reused chunks (exact has none), once; "
                                 f"write modular:ape, blend:RATIO:SELECTION:ape or auto:TARGET:ape")
            return replace(base, align="ape")
        mode, _, rest = text.partition(":")
        if mode in ("exact", "modular") and not rest:
            return cls(mode)
        if mode == "blend":
            ratio, _, selection = rest.partition(":")
            try:
                r = float(ratio) if ratio else 0.2
            except ValueError:
                r = -1.0
            selection = selection or "progressive"
            if not 0.0 <= r <= 1.0 or selection not in SELECTIONS:
                raise PCRagError(f"check: bad blend setting {spec!r}; write blend:RATIO:SELECTION with RATIO in [0, 1] "
                                 f"and SELECTION one of {', '.join(SELECTIONS)}")
            return cls("blend", r, selection)
        if mode == "auto":
            try:
                target = float(rest) if rest else 0.9
            except ValueError:
                target = -1.0
            if not 0.0 <= target <= 1.0:
                raise PCRagError(f"check: bad quality target {spec!r}; write auto:TARGET with TARGET in [0, 1]")
            return cls("blend", None, "progressive", target)
        raise PCRagError(f"check: unknown mode {spec!r}; choose exact, modular, blend[:RATIO[:SELECTION]] "
                         f"or auto[:TARGET], each but exact with :ape for APE (ape alone: modular:ape) "
                         f"(full is the reference every mode is compared with)")


@dataclass
class ModeResult:
    """One mode against full over every prompt."""

    name: str
    mode: str
    recompute_ratio: float | None
    selection: str | None
    recompute_target: float | None = None  # "auto" settings: blend's quality target
    align: str | None = None  # "ape": APE's alignment (pc_rag/align.py)
    prompts: int = 0
    identical: int = 0  # prompts whose greedy answer is full's, token for token
    agreement: float = 0.0  # identical / prompts
    agreement_interval: tuple[float, float] = (0.0, 1.0)  # Wilson 95%
    first_divergence_mean: float | None = None  # over the prompts that differ: first differing answer token index
    kl_mean: float = 0.0  # nats, mean over every teacher-forced answer position of every prompt
    kl_max: float = 0.0
    ttft_median_s: float = 0.0
    speedup_vs_full: float = 0.0  # full's median TTFT / this mode's
    reused_tokens_mean: float = 0.0  # prompt tokens whose KV came from the store, first request per prompt
    recomputed_tokens_mean: float = 0.0  # blend: reused tokens recomputed in context, first request per prompt
    refused: str | None = None  # why the engine refused the mode for this model (then nothing else is measured)


@dataclass
class CheckReport:
    prompts: int
    max_new_tokens: int
    target: float
    prompt_tokens_mean: float
    answer_tokens_mean: float
    full_ttft_median_s: float
    modes: list[ModeResult]
    cheapest: str | None  # the lowest median TTFT among modes whose agreement reaches target
    reference_mismatches: int  # answer tokens where the reference forward's most likely token is not full's
    warm: dict = field(default_factory=dict)  # what was encoded before measuring: chunks, passage requests
    seconds: float = 0.0
    seconds_by_step: dict = field(default_factory=dict)  # where the time went: warm, full, reference, each mode
    # per prompt: full's answer, and per mode the first differing answer token (None: identical) and mean KL
    per_prompt: list = field(default_factory=list)
    load: dict = field(default_factory=dict)  # the machine's load average before and after, and its CPUs
    cannot_tell: str = CANNOT_TELL

    def mode(self, name: str) -> ModeResult:
        return next(m for m in self.modes if m.name == name)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["modes"] = {m.name: {k: v for k, v in asdict(m).items() if k != "name"} for m in self.modes}
        return out

    def __str__(self) -> str:
        lines = [f"{self.prompts} prompts ({self.prompt_tokens_mean:.0f} tokens on average), greedy answers of up to "
                 f"{self.max_new_tokens} tokens ({self.answer_tokens_mean:.1f} on average), each mode against full",
                 ""]
        head = (f"{'mode':<24}{'agreement':>16}{'first diverges':>16}{'KL from full':>14}{'TTFT median':>13}"
                f"{'vs full':>9}{'reused':>8}{'recomputed':>12}")
        lines += [head, "-" * len(head)]
        lines.append(f"{'full':<24}{'(reference)':>16}{'':>16}{'':>14}{self.full_ttft_median_s * 1e3:>10.1f} ms"
                     f"{'1.0x':>9}{0:>8}{0:>12}")
        for m in self.modes:
            if m.refused:
                lines.append(f"{m.name:<24}refused: {m.refused}")
                continue
            agree = f"{m.agreement:.2f} ({m.identical}/{m.prompts})"
            diverge = f"token {m.first_divergence_mean:.1f}" if m.first_divergence_mean is not None else "-"
            lines.append(f"{m.name:<24}{agree:>16}{diverge:>16}{m.kl_mean:>14.2e}{m.ttft_median_s * 1e3:>10.1f} ms"
                         f"{m.speedup_vs_full:>8.1f}x{m.reused_tokens_mean:>8.0f}{m.recomputed_tokens_mean:>12.0f}")
        lines.append("")
        if self.cheapest:
            m = self.mode(self.cheapest)
            lines.append(f"Cheapest within agreement >= {self.target:g}: {m.name} (TTFT "
                         f"{m.ttft_median_s * 1e3:.1f} ms, {m.speedup_vs_full:.1f}x full's speed).")
        else:
            lines.append(f"No mode reaches agreement >= {self.target:g} on these prompts: use full, or look at the KL "
                         "and first-divergence columns to see how far the nearest one is.")
        measured = [m for m in self.modes if not m.refused]
        if measured:  # the spread an agreement figure has on this many prompts, shown on the least certain one
            m = min(measured, key=lambda m: abs(m.agreement - 0.5))
            low, high = m.agreement_interval
            lines.append(f"Agreement is measured on {self.prompts} prompts: {m.name}'s {m.agreement:.2f} means "
                         f"somewhere in [{low:.2f}, {high:.2f}] (95%).")
        lines += ["What this cannot tell: " + self.cannot_tell,
                  "TTFT: the first request of each prompt in each mode, its documents already encoded (a new question "
                  "over documents seen before); exact reuses only a prefix seen in the same order.",
                  f"Took {self.seconds:.0f} s; load average {self.load.get('before', '?')} before, "
                  f"{self.load.get('after', '?')} after, on {self.load.get('cpus', '?')} CPUs."]
        return "\n".join(lines)


def check(engine, prompts: Sequence, modes: Sequence[str | Setting] = DEFAULT_MODES, max_new_tokens: int = 16,
          target: float = 0.9, progress: bool = False) -> CheckReport:
    """Compare each of `modes` with full on `prompts` (plain strings, or lists of pc_rag.Text and pc_rag.Chunk);
    see the module docstring for what is measured and how. Leaves the prompts' KV in the engine's store, as any
    request does. Not for an engine serving other requests meanwhile: it sets `engine.blend_selection` per blend
    setting (and puts it back)."""
    from tqdm.auto import tqdm

    settings = [Setting.parse(m) for m in modes]
    if not settings:
        raise PCRagError("check: no modes to compare with full; give at least one of exact, modular, blend")
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        raise PCRagError(f"check: a mode is given twice in {names}")
    if not 0.0 <= target <= 1.0:
        raise PCRagError(f"check: target is an agreement share in [0, 1], got {target}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise PCRagError(f"check: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    prompts = _checked_prompts(prompts)
    t_start = time.perf_counter()
    load = {"before": _loadavg(), "cpus": os.cpu_count()}
    spent = dict.fromkeys(["warm", "full", "reference", *names], 0.0)
    t = time.perf_counter()
    warm = _warm(engine, prompts)
    engine.next_token_logits(prompts[0], mode="full")  # set-up (allocator, kernels) outside every timing
    spent["warm"] += time.perf_counter() - t

    results = {s.name: ModeResult(s.name, s.mode, s.recompute_ratio, s.selection, s.recompute_target, s.align)
               for s in settings}
    per_mode = {s.name: {"ttft": [], "kl": [], "diverge": [], "reused": [], "recomputed": []} for s in settings}
    full_ttft, prompt_tokens, answer_tokens, mismatches, details = [], [], [], 0, []
    order = [s for s in settings if s.mode != "exact"] + [s for s in settings if s.mode == "exact"]
    saved_selection = engine.blend_selection
    bar = tqdm(total=len(prompts) * (1 + len(settings)), desc="pc-rag check", unit="request", disable=not progress)
    try:
        for prompt in prompts:
            t = time.perf_counter()
            segments = engine.split(prompt) if isinstance(prompt, str) else list(prompt)
            full = engine.generate(prompt, mode="full", max_new_tokens=max_new_tokens)
            t, spent["full"] = time.perf_counter(), spent["full"] + time.perf_counter() - t
            answer = list(full.token_ids)
            ended = full.finish_reason == "stop"  # no stop strings here: the model chose an end-of-sequence token
            steps = len(answer) + ended
            reference = _reference_logprobs(engine, list(full.prompt_ids), answer, steps)
            mismatches += sum(int(reference[j].argmax()) != answer[j] for j in range(len(answer)))
            spent["reference"] += time.perf_counter() - t
            record = {"full_answer": full.text, "answer_tokens": len(answer), "modes": {}}
            details.append(record)
            full_ttft.append(full.ttft_s)
            prompt_tokens.append(full.prompt_tokens)
            answer_tokens.append(len(answer))
            bar.update(1)
            for s in order:
                r, acc = results[s.name], per_mode[s.name]
                if r.refused:
                    bar.update(1)
                    continue
                t = time.perf_counter()
                if s.mode == "blend":
                    engine.blend_selection = s.selection
                ratio = s.recompute_ratio if s.mode == "blend" and s.recompute_ratio is not None else 0.0
                try:
                    first = engine.generate(prompt, mode=s.mode, max_new_tokens=1, recompute_ratio=ratio,
                                            recompute_target=s.recompute_target, align=s.align)
                except UnsupportedModelError as e:
                    r.refused = str(e)
                    bar.update(1)
                    continue
                acc["ttft"].append(first.ttft_s)
                acc["reused"].append(first.cached_tokens)
                acc["recomputed"].append(first.recomputed_tokens)
                diverged, kls = None, []
                for j in range(steps):
                    forced = segments + [Text(engine.tokenizer.decode(answer[:j]), token_ids=tuple(answer[:j]))] \
                        if j else segments
                    logits = engine.next_token_logits(forced, mode=s.mode, recompute_ratio=ratio,
                                                      recompute_target=s.recompute_target,
                                                      align=s.align).float().cpu()
                    logp = torch.log_softmax(logits, -1)
                    kls.append(float(torch.sum(reference[j].exp() * (reference[j] - logp))))
                    pick = int(logp.argmax())
                    same = pick == answer[j] if j < len(answer) else pick in engine.eos_ids
                    if not same and diverged is None:
                        diverged = j
                spent[s.name] += time.perf_counter() - t
                acc["kl"] += kls
                record["modes"][s.name] = {"first_divergence": diverged,
                                           "kl_mean": statistics.fmean(kls) if kls else 0.0}
                r.prompts += 1
                if diverged is None:
                    r.identical += 1
                else:
                    acc["diverge"].append(diverged)
                bar.update(1)
    finally:
        engine.blend_selection = saved_selection
        bar.close()

    full_median = statistics.median(full_ttft)
    for s in settings:
        r, acc = results[s.name], per_mode[s.name]
        if r.refused:
            continue
        r.agreement = r.identical / r.prompts
        r.agreement_interval = _wilson(r.identical, r.prompts)
        r.first_divergence_mean = statistics.fmean(acc["diverge"]) if acc["diverge"] else None
        r.kl_mean = statistics.fmean(acc["kl"]) if acc["kl"] else 0.0
        r.kl_max = max(acc["kl"], default=0.0)
        r.ttft_median_s = statistics.median(acc["ttft"])
        r.speedup_vs_full = full_median / r.ttft_median_s if r.ttft_median_s > 0 else 0.0
        r.reused_tokens_mean = statistics.fmean(acc["reused"])
        r.recomputed_tokens_mean = statistics.fmean(acc["recomputed"])
    within = [r for r in results.values() if not r.refused and r.agreement >= target]
    cheapest = min(within, key=lambda r: r.ttft_median_s).name if within else None
    load["after"] = _loadavg()
    return CheckReport(len(prompts), max_new_tokens, target, statistics.fmean(prompt_tokens),
                       statistics.fmean(answer_tokens), full_median, [results[n] for n in names], cheapest,
                       mismatches, warm, time.perf_counter() - t_start, {k: round(v, 2) for k, v in spent.items()},
                       details, load)


def rag_prompt(documents: Sequence[str], question: str, system: str = "", plain: bool = False) -> list | str:
    """The demo's RAG layout: the system text, each document (a `Chunk`) after a blank line, then
    `Question: ...` and `Answer:`. `plain`: the same text as one string (documents then reused as passages)."""
    parts: list[Text | Chunk] = []
    if system:
        parts.append(Text(system if system.endswith("\n") else system + "\n\n"))
    for i, d in enumerate(documents):
        if i:
            parts.append(Text("\n\n"))
        parts.append(Chunk(d))
    parts.append(Text(("\n\n" if documents or system else "") + f"Question: {question}\nAnswer:"))
    return "".join(p.text for p in parts) if plain else parts


def _checked_prompts(prompts) -> list:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise PCRagError("check: prompts is a list of prompts (each a string, or a list of pc_rag.Text and "
                         "pc_rag.Chunk)")
    if not prompts:
        raise PCRagError("check: no prompts to check")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise PCRagError(f"check: prompt {i} is empty")
            out.append(p)
            continue
        if isinstance(p, (Text, Chunk)) or not isinstance(p, Sequence) or not p or \
                not all(isinstance(s, (Text, Chunk)) for s in p):
            raise PCRagError(f"check: prompt {i} is neither a string nor a non-empty list of pc_rag.Text and "
                             f"pc_rag.Chunk")
        if any(s.position is not None or getattr(s, "encode_position", None) is not None for s in p):
            raise PCRagError(f"check: prompt {i} gives explicit positions, which check does not support (its "
                             f"reference lays the prompt out contiguously); leave position unset")
        out.append(list(p))
    return out


def _warm(engine, prompts: list) -> dict:
    """Encode and store every document before measuring (see the module docstring): chunks by `engine.warm`; the
    passages of plain strings by requests made of those passages alone (with the tokens they have in their prompts,
    so that the prompts find them), in order of first appearance, a few thousand tokens per request."""
    chunks = list(dict.fromkeys(s for p in prompts if not isinstance(p, str) for s in p if isinstance(s, Chunk)))
    encoded = engine.warm(chunks, progress=False) if chunks else 0
    passages: dict[tuple[int, ...], Text] = {}
    for p in prompts:
        if isinstance(p, str):
            for s in engine.split(p):
                if isinstance(s, Text) and s.passage and s.token_ids:
                    passages.setdefault(s.token_ids, s)
    context = getattr(engine.model.config, "max_position_embeddings", None) or 2 * WARM_GROUP_TOKENS
    budget = min(WARM_GROUP_TOKENS, context // 2)
    groups: list[list[Text]] = [[]]
    size = 0
    for ids, s in passages.items():
        if groups[-1] and size + len(ids) > budget:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += len(ids)
    requests = 0
    for group in groups:
        if group:
            engine.next_token_logits(group, mode="modular")  # after it, the engine encodes the passages it sent
            requests += 1
    return {"chunks": len(chunks), "chunks_encoded": encoded, "passages": len(passages), "passage_requests": requests}


def _reference_logprobs(engine, prompt_ids: list[int], answer: list[int], steps: int) -> torch.Tensor:
    """Full's next-token log-probabilities after the prompt and each prefix of its answer, [steps, vocab]: one
    forward of the model over prompt + answer (what `full` computes, to 1e-4), keeping the last `steps` logits."""
    model = engine.model
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + answer[: steps - 1]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, logits_to_keep=steps, use_cache=False).logits[0]
    return torch.log_softmax(logits.float().cpu(), -1)


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a share k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"
