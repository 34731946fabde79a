"""Aligning attention over reused chunks without recomputing them: APE (Yang, Chen, Chen, ICLR 2025, "Adaptive
Parallel Encoding"), training-free.

In `modular`, every chunk was encoded on its own (after the BOS sink only) and never saw the others; the tokens
computed after them (the question, the reply) spread their attention over k such chunks as no full prefill does.
APE changes what those later tokens see, not the cached KV:

- a shared prefix before every context, so that the contexts' first states are not k duplicate attention sinks:
  pc_rag already encodes every chunk after the same BOS token (`Planner.sink_ids`) and keeps that BOS's KV once, at
  slot 0 of the request (a chunk's block holds its own tokens only: `Assembler.encode_chunks` drops the sink's
  slots), so nothing more is done here. A longer shared prefix (the system text) is not encoded before each chunk;
- a temperature T (<= 1 sharpens) on the logits of those tokens over the reused chunks' keys: q.k / (sqrt(d) T);
- a scaling factor S on the reused chunks' attention weight before the softmax normalisation, i.e. log S added
  to the same logits.

For a query row r (a slot the request computes that holds no reused chunk KV) and a key slot c:

    logit(r, c) = q_r.k_c * scale / T + log S   where slot c holds a reused chunk's KV as cached
                = q_r.k_c * scale               elsewhere (the sink, exact prefix blocks, text, the question)

then the causal mask and one softmax over all keys. T = S = 1 is modular. A prompt without reused chunks has
nothing to align and runs as without APE.

How it runs (`attend`): the scores are computed in fp32 by plain torch ops (device-agnostic: CPU or CUDA), in
blocks of query rows, for every forward and decode step of a request that asked for APE; the native kernels and
sdpa are not used for it, since neither takes a per-key bias. T cannot be folded into the buffer's keys (k / T,
which commutes with RoPE) because blend's recomputed chunk rows read the same keys without it (they emulate a
full prefill, where nothing is scaled), and S needs a per-key bias anyway. The store's blocks and the buffer's
keys are never changed: other requests and modes read them.

Which slots hold reused KV can change while blend runs: a chunk token recomputed in context at layer i holds
fresh KV in that layer (not aligned there), and keeps its cached KV in the layers after the one that dropped it
(`Aligned.computed`). So the mask of aligned slots is kept per layer.

T and S per model: `calibrate` searches a small grid for the pair that brings modular's next-token distribution
closest to full's (mean KL) on calibration prompts, and remembers it per model fingerprint in this process
(`CALIBRATED`); uncalibrated, `DEFAULT` (the paper's released default, T = S = 0.9).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import OptionError

ALIGNS = ("ape",)

# The APE authors' released default (their README: temperature and scaling factor 0.9, "over 90% on few-shot
# tasks"): the setting used until a model is calibrated.
DEFAULT_TEMPERATURE = 0.9
DEFAULT_SCALE = 0.9
# The grid `calibrate` searches: temperatures from none (1) to strong sharpening, and scales on both sides of 1
# (the paper tunes T in [0.5, 1] and S around 1). On the 8-layer retrieval testbed the KL kept falling, slowly,
# towards the grid's lower edge in S (0.8 chosen of 0.8-3, then 0.3 of 0.3-3, on 256 prompts), so it reaches 0.1.
TEMPERATURES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
SCALES = (0.1, 0.2, 0.3, 0.5, 0.65, 0.8, 0.9, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0)

ROWS_PER_BLOCK = 256  # query rows per block of scores: bounds [heads, rows, keys] fp32


@dataclass(frozen=True)
class APE:
    """APE's temperature (in (0, 1]: 1 = none) and scaling factor (> 0: 1 = none) on reused chunks' logits."""

    temperature: float = DEFAULT_TEMPERATURE
    scale: float = DEFAULT_SCALE

    def __post_init__(self):
        for name, value, high in (("temperature", self.temperature, 1.0), ("scale", self.scale, 10.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and 0.0 < value <= high):
                raise OptionError(f"APE {name} must be a number in (0, {high:g}], got {value!r}")

    @property
    def log_scale(self) -> float:
        return math.log(self.scale)

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "scale": self.scale}


DEFAULT = APE()
CALIBRATED: dict[str, APE] = {}  # model fingerprint -> the pair `calibrate` chose
_lock = threading.Lock()


def check_align(align, mode: str) -> str | None:
    """`align` as a request may pass it: None (off) or "ape", with a mode that reuses chunks."""
    if align is None:
        return None
    if not isinstance(align, str) or align not in ALIGNS:
        raise OptionError(f"align must be None or one of {', '.join(ALIGNS)}, got {align!r}")
    if mode not in ("modular", "blend"):
        raise OptionError(f"align={align!r} aligns attention over reused chunks: it takes mode 'modular' or "
                          f"'blend', got mode {mode!r} (which reuses none)")
    return align


class Aligned:
    """A request's alignment, held by its buffer (`SlotCache.align`) while it runs: which slots hold reused chunk
    KV, per layer, and the APE pair.

    reused: [capacity] bool, the slots whose KV came from chunk blocks (queries there are never aligned: blend's
            recomputed chunk rows emulate a full prefill).
    mask:   [layers, capacity] bool, the slots whose keys in that layer are still the cached ones (blend's rows
            computed in a layer are taken out of it: `computed`)."""

    def __init__(self, ape: APE, reused: torch.Tensor, layers: int):
        self.ape = ape
        self.reused = reused
        self.mask = reused[None].repeat(layers, 1)

    @classmethod
    def of(cls, ape: APE, slots: Sequence[int], capacity: int, layers: int, device) -> Aligned | None:
        """The alignment of a buffer of `capacity` slots whose `slots` hold reused chunk KV; None without any."""
        if not slots:
            return None
        reused = torch.zeros(capacity, dtype=torch.bool, device=device)
        reused[torch.tensor(list(slots), device=device)] = True
        return cls(ape, reused, layers)

    def computed(self, layer: int, rows: torch.Tensor) -> None:
        """Slots `rows` of `layer` were written by a forward: they hold fresh KV there from now on."""
        self.mask[layer, rows] = False


def aligned_slots(pieces) -> list[int]:
    """The slots of a plan's pieces (as built) whose KV is a relocated block (chunks, passages, scaffolds and the
    separators between them), whether read, copied or encoded by this very request: each was encoded on its own."""
    return [s for p in pieces if p.relocated for s in range(p.slot, p.slot + p.n)]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, scaling: float,
           group: int, window: int | None, softcap: float | None, aligned: Aligned, layer: int) -> torch.Tensor:
    """APE attention of the query rows q [1, H_q, n, D] at slots `rows` [n] over one layer's keys / values
    [1, H_kv, T, D] (slots [0, T)), each row seeing the slots up to its own (within `window`): the logits over
    `aligned`'s slots of this layer divided by T and raised by log S for rows outside the reused slots (the module
    docstring's formula). Scores and softmax in fp32, in blocks of ROWS_PER_BLOCK rows; returns [1, H_q, n, D] in
    q's dtype."""
    _, h, n, d = q.shape
    h_kv = keys.shape[1]
    inv_t, log_s = 1.0 / aligned.ape.temperature, aligned.ape.log_scale
    cached = aligned.mask[layer]
    out = []
    for a in range(0, n, ROWS_PER_BLOCK):
        at = rows[a: a + ROWS_PER_BLOCK]  # [r] query slots
        r = len(at)
        high = int(at.max()) + 1
        lo = 0 if window is None else max(0, int(at.min()) - window + 1)
        slots = torch.arange(lo, high, device=q.device)
        k = keys[0, :, lo:high].float()  # [H_kv, T', D]
        v = values[0, :, lo:high].float()
        qb = q[0, :, a: a + r].float().reshape(h_kv, group * r, d)  # query heads of one KV head as its rows
        scores = torch.matmul(qb, k.transpose(1, 2)).reshape(h_kv, group, r, -1) * scaling  # [H_kv, g, r, T']
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        boost = (~aligned.reused[at])[:, None] & cached[lo:high][None, :]  # [r, T']: aligned (row, key) pairs
        scores = torch.where(boost, scores * inv_t + log_s, scores)
        visible = slots[None, :] <= at[:, None]
        if window is not None:
            visible &= slots[None, :] > at[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).reshape(h_kv, group * r, -1)
        out.append(torch.matmul(weights, v).reshape(h, r, d))
    o = torch.cat(out, 1) if len(out) > 1 else out[0]
    return o[None].to(q.dtype)


def ape_for(engine) -> APE:
    """The APE pair for the engine's model: the engine's own (`Engine.ape`), else this process's calibration of the
    model (`calibrate`), else DEFAULT."""
    if engine.ape is not None:
        return engine.ape
    return CALIBRATED.get(engine.planner.fingerprint, DEFAULT)


def calibrate(engine, prompts=None, temperatures: Sequence[float] = TEMPERATURES,
              scales: Sequence[float] = SCALES) -> tuple[APE, dict]:
    """Choose T and S for the engine's model: on `prompts` (default: the quality gate's built-in prompts,
    quality.calibration_prompts), the pair of the grid whose next-token distribution (modular with APE) is closest
    to full's, by mean KL(full || APE). Measured in a store of its own (nothing kept in the engine's), remembered
    per model fingerprint (`CALIBRATED`) and set as the engine's. Returns the pair and, per pair tried, its mean KL
    and top-1 agreement with full."""
    from .assemble import Recompute
    from .quality import _fitting, _own_assembler, calibration_prompts

    with _lock:
        planner, assembler = _own_assembler(engine)
        if prompts is None:
            built = [_fitting(engine, lambda chars, i=i: calibration_prompts(chars)[i])
                     for i in range(len(calibration_prompts()))]
        else:
            from .request import prompt_segments

            built = [prompt_segments(engine, p, "modular")[0] for p in prompts]
        fulls, plans = [], []
        for segments in built:
            for seg in segments:  # each chunk's own encoding first, as a warm cache holds it
                if seg.kind in ("chunk", "passage"):
                    assembler.ensure_stored(planner.chunk_wanted(seg))
            lookups = assembler.lookups()
            # full: blend recomputing every chunk token (full up to float rounding), as quality.py measures it
            asm = assembler.assemble(planner.plan(segments, "blend", lookups), lookups.blocks, 0,
                                     Recompute(1.0, "deviation"))
            engine.runner.release_cache(asm.cache)
            fulls.append(torch.log_softmax(asm.logits.float(), -1))
            plans.append(segments)
        table = {}
        for t in temperatures:
            for s in scales:
                ape = APE(t, s)
                kl = agree = 0.0
                for segments, logp_full in zip(plans, fulls, strict=True):
                    lookups = assembler.lookups()
                    asm = assembler.assemble(planner.plan(segments, "modular", lookups, align=ape),
                                             lookups.blocks, 0)
                    engine.runner.release_cache(asm.cache)
                    logp = torch.log_softmax(asm.logits.float(), -1)
                    kl += float((logp_full.exp() * (logp_full - logp)).sum()) / len(plans)
                    agree += (int(logp.argmax()) == int(logp_full.argmax())) / len(plans)
                table[(t, s)] = {"kl": kl, "agreement": agree}
        best = min(table, key=lambda ts: (table[ts]["kl"], abs(1 - ts[0]) + abs(1 - ts[1])))
        chosen = APE(*best)
        CALIBRATED[engine.planner.fingerprint] = chosen
        engine.ape = chosen
        return chosen, table
