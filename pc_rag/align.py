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

How it runs (pc_rag/model/aligned.py, `attend`): the scores are computed in fp32 by plain torch ops
(device-agnostic: CPU or CUDA), in blocks of query rows, for every forward and decode step of a request that asked
for APE; the native kernels and sdpa are not used for it, since neither takes a per-key bias. T cannot be folded
into the buffer's keys (k / T, which commutes with RoPE) because blend's recomputed chunk rows read the same keys
without it (they emulate a full prefill, where nothing is scaled), and S needs a per-key bias anyway. The store's
blocks and the buffer's keys are never changed: other requests and modes read them.

Which slots hold reused KV can change while blend runs: a chunk token recomputed in context at layer i holds
fresh KV in that layer (not aligned there), and keeps its cached KV in the layers after the one that dropped it
(`model.aligned.Aligned.computed`). So the mask of aligned slots is kept per layer.

T and S per model: `quality.calibrate_ape` searches a small grid for the pair that brings modular's next-token
distribution closest to full's (mean KL) on calibration prompts, and remembers it per model fingerprint in this
process (`CALIBRATED`) and in the engine's cache folder (`Engine.calibration_dir`: the disk tier's folder, so the
default store's ~/.cache/pc_rag), as calibration/ape-<hash of the fingerprint>.json. An engine whose folder holds
its fingerprint's file starts with that pair: `pc-rag check --calibrate-ape` calibrates once, and `pc-rag serve`
on the same folder uses it. The file names the whole fingerprint, and a file that does not (a hash collision, a
copy from elsewhere) or that cannot be read is ignored with a warning, never used for another model. Uncalibrated,
`DEFAULT` (the paper's released default, T = S = 0.9).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import OptionError

log = logging.getLogger(__name__)

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
CALIBRATED: dict[str, APE] = {}  # model fingerprint -> the pair `quality.calibrate_ape` chose


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


def aligned_slots(pieces) -> list[int]:
    """The slots of a plan's pieces (as built) whose KV is a relocated block (chunks, passages, scaffolds and the
    separators between them), whether read, copied or encoded by this very request: each was encoded on its own."""
    return [s for p in pieces if p.relocated for s in range(p.slot, p.slot + p.n)]


def ape_for(engine) -> APE:
    """The APE pair for the engine's model: the engine's own (`Engine.ape`), else this process's calibration of the
    model (`quality.calibrate_ape`, or the saved one its engine found at start: `load_calibration`), else DEFAULT."""
    if engine.ape is not None:
        return engine.ape
    return CALIBRATED.get(engine.planner.fingerprint, DEFAULT)


# ---- calibrations kept in a cache folder -----------------------------------------------------------------------
CALIBRATION_DIR = "calibration"


def calibration_file(folder: str | os.PathLike, fingerprint: str) -> Path:
    """Where `folder` keeps the APE calibration of the model with `fingerprint`."""
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:32]
    return Path(folder).expanduser() / CALIBRATION_DIR / f"ape-{digest}.json"


def save_calibration(folder: str | os.PathLike, fingerprint: str, ape: APE, table: dict, prompts: int) -> Path:
    """Write the chosen pair and what each pair tried measured (mean KL, top-1 agreement with full), atomically: a
    reader sees the old file or the new one, never half of one."""
    path = calibration_file(folder, fingerprint)
    record = {"fingerprint": fingerprint, **ape.as_dict(), "prompts": prompts,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "measured": [{"temperature": t, "scale": s, **m} for (t, s), m in table.items()]}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ape-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remember_saved(folder: str | os.PathLike, fingerprint: str) -> None:
    """Take the pair `folder` keeps for `fingerprint` as this process's calibration, unless this process already
    calibrated the model (its own measurement is the newer)."""
    if fingerprint not in CALIBRATED:
        saved = load_calibration(folder, fingerprint)
        if saved is not None:
            CALIBRATED[fingerprint] = saved


def load_calibration(folder: str | os.PathLike, fingerprint: str) -> APE | None:
    """The pair `folder` keeps for `fingerprint`, or None: no file, or one that is damaged or names another
    fingerprint (warned about: recalibrating rewrites it)."""
    path = calibration_file(folder, fingerprint)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the APE calibration %s: unreadable (%s); the default pair is used", path, e)
        return None
    try:
        if record["fingerprint"] != fingerprint:
            raise ValueError("it is another model's")
        return APE(record["temperature"], record["scale"])
    except (TypeError, KeyError, ValueError, OptionError) as e:
        log.warning("ignoring the APE calibration %s: %s; the default pair is used", path, e)
        return None
