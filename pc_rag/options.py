"""What a request asks for besides its prompt, checked once at the call: `GenerationOptions`, and the device.

`Engine.generate`, `stream` and `stream_generation` take the same keyword arguments; each builds one
`GenerationOptions` before any work starts (so a bad `stream(...)` fails at the call, not at its first
`next()`), and that object travels down the request path.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import OptionError, OptionTypeError, PromptError

# What a request can ask for (see `Engine`): no reuse (the reference), exact prefix reuse, relocated chunks, and
# relocated chunks with a share recomputed in context.
MODES = ("full", "exact", "modular", "blend")

# torch.Generator.manual_seed takes any 64-bit seed, signed or unsigned; outside that it overflows.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


# blend's default share of reused chunk tokens recomputed (with Engine.blend_selection): docs/results.md, "Blend".
DEFAULT_RECOMPUTE_RATIO = 0.2


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate: the engine's keyword arguments as one checked, normalised value.

    mode:            "full" | "exact" | "modular" | "blend" (see `Engine`).
    max_new_tokens:  at most this many tokens (>= 1); fewer when the model's context runs out.
    temperature:     0 = greedy; otherwise softmax temperature (finite, >= 0).
    top_p:           nucleus sampling mass, in (0, 1].
    stop:            None, one string or strings; stored as a tuple, empty strings dropped (they would
                     match at once).
    seed:            None (fresh randomness) or a 64-bit int.
    recompute_ratio: blend only: fraction of reused chunk tokens recomputed, in [0, 1].
    """

    mode: str = "modular"
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO

    def __post_init__(self):
        check_mode(self.mode)
        set_ = object.__setattr__  # frozen: normalised values are written once, here
        set_(self, "max_new_tokens", checked_int("max_new_tokens", self.max_new_tokens, low=1))
        for name, value in zip(("temperature", "top_p", "seed"),
                               checked_sampling(self.temperature, self.top_p, self.seed), strict=True):
            set_(self, name, value)
        set_(self, "stop", checked_stop(self.stop))
        ratio = checked_number("recompute_ratio", self.recompute_ratio, 0.0, 1.0, hint="0 = modular, 1 = full")
        set_(self, "recompute_ratio", ratio)


def check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise PromptError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def check_device(device) -> str:
    """`device` as torch spells it, once it is known to exist here: called before any weights load, since a
    missing CUDA otherwise surfaces as an assertion deep inside torch after the checkpoint was read."""
    import torch

    if not isinstance(device, (str, torch.device)):
        raise OptionTypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise OptionError(f"device {str(device)!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return str(dev)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise OptionError(f"device {str(device)!r}: {why} (torch {torch.__version__}); use cpu, or "
                              f"install a CUDA build of torch")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise OptionError(f"device {str(device)!r}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
        return str(dev)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise OptionError(f"device {str(device)!r}: MPS (Apple GPU) is not available here; use cpu")
        return str(dev)
    raise OptionError(f"device {str(device)!r}: pc_rag runs on cpu, cuda, cuda:N or mps")


# ---- checks shared by GenerationOptions and decode.Sampling; each message names the argument --------------
def checked_sampling(temperature, top_p, seed) -> tuple[float, float, int | None]:
    """The sampling arguments, checked and normalised (GenerationOptions and decode.Sampling share it)."""
    temperature = checked_number("temperature", temperature, 0.0, None, hint="0 = greedy")
    top_p = checked_number("top_p", top_p, 0.0, 1.0, low_open=True, hint="1 = no nucleus cut")
    if seed is not None:
        seed = checked_int("seed", seed, hint="or None")
        if not SEED_MIN <= seed <= SEED_MAX:
            raise OptionError(f"seed must fit in 64 bits (-2**63 to 2**64 - 1), got {seed}")
    return temperature, top_p, seed


def checked_int(name: str, value, low: int | None = None, hint: str = "") -> int:
    # bool is an int to Python, but `seed=True` or `max_new_tokens=True` is a mistake, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = f" ({hint})" if hint else ""
        raise OptionTypeError(f"{name} must be an int{hint}, got {_shown(value)}")
    value = int(value)
    if low is not None and value < low:
        raise OptionError(f"{name} must be >= {low}, got {value}")
    return value


def checked_number(name: str, value, low: float, high: float | None, low_open: bool = False, hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionTypeError(f"{name} must be a number ({hint}), got {_shown(value)}")
    value = float(value)
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and (high is None or value <= high)):
        bound = f"finite and >= {low:g}" if high is None else f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise OptionError(f"{name} must be {bound} ({hint}), got {value}")
    return value


def checked_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Iterable):
        raise OptionTypeError(f"stop must be None, a string or a list of strings, got {type(stop).__name__}")
    stop = tuple(stop)
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            ids = "; stop takes strings, not token ids" if isinstance(s, numbers.Integral) else ""
            raise OptionTypeError(f"stop[{i}] must be a string, got {_shown(s)}{ids}")
    return tuple(s for s in stop if s)


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:40] + '...'}"
