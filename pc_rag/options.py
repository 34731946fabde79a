"""What a request asks for besides its prompt, checked once at the call: `GenerationOptions`, and the device.

`Engine.generate`, `stream` and `stream_generation` take the same keyword arguments; each builds one
`GenerationOptions` before any work starts (so a bad `stream(...)` fails at the call, not at its first
`next()`), and that object travels down the request path.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .align import check_align
from .errors import OptionError, OptionTypeError, PromptError
from .grammar import Grammar
from .segments import unicode_problem

# What a request can ask for (see `Engine`): no reuse (the reference), exact prefix reuse, relocated chunks, and
# relocated chunks with a share recomputed in context.
MODES = ("full", "exact", "modular", "blend")

# torch.Generator.manual_seed takes any 64-bit seed, signed or unsigned; outside that it overflows.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


# blend's default share of reused chunk tokens recomputed (with Engine.blend_selection): docs/results.md, "Blend".
DEFAULT_RECOMPUTE_RATIO = 0.2

MAX_CACHE_SALT_CHARS = 256  # vLLM's field has no bound; ours keeps a key derivation's input small

# OpenAI's bounds: top_logprobs 0 to 20, penalties -2 to 2, a logit bias -100 to 100.
MAX_TOP_LOGPROBS = 20
PENALTY_BOUND = 2.0
LOGIT_BIAS_BOUND = 100.0


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
    cache_salt:      None, or the request's cache namespace (1 to 256 characters; vLLM's name): the request
                     reuses only KV that requests with the same salt stored, and public chunks (blocks.py).
    grammar:         None, or a `pc_rag.Grammar` every generated token must keep to (constrained decoding).
    n:               how many replies (choices) to the one prompt, >= 1: its prefill runs once and the n replies
                     decode from its KV as n rows of the batched step (each its own sampler; a seed s gives
                     choice 0 the seed s and the others seeds derived from s).
    logprobs:        None (none recorded), or k in [0, 20]: each generated token's log-probability and the k most
                     likely tokens of its step, from the logits the sampler chose from (logit_bias, penalties
                     and a grammar's mask applied; before temperature and top_p).
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: a token's logit is lowered by
                     `presence_penalty` once it was generated, and by `frequency_penalty` per time it was (the
                     reply's tokens so far; the prompt's are not counted).
    logit_bias:      None, or {token id: bias in [-100, 100]} added to those logits at every step (OpenAI's);
                     stored as sorted (id, bias) pairs. The engine checks the ids against its vocabulary.
    recompute_target: blend only: None (the engine's `recompute_target`, else `recompute_ratio`), or a quality
                     target in [0, 1]: as many reused chunk tokens recomputed as this prompt needs (assemble.Recompute).
    align:           None, or "ape" (modular and blend only): the tokens computed after the reused chunks attend to
                     them with APE's temperature and scale, the engine's pair (`Engine.ape`, else its model's
                     calibration, else the default: align.py).
    """

    mode: str = "modular"
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    cache_salt: str | None = None
    grammar: Grammar | None = None
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    recompute_target: float | None = None
    align: str | None = None

    def __post_init__(self):
        check_mode(self.mode)
        check_align(self.align, self.mode)
        set_ = object.__setattr__  # frozen: normalised values are written once, here
        set_(self, "max_new_tokens", checked_int("max_new_tokens", self.max_new_tokens, low=1))
        for name, value in zip(("temperature", "top_p", "seed"),
                               checked_sampling(self.temperature, self.top_p, self.seed), strict=True):
            set_(self, name, value)
        set_(self, "stop", checked_stop(self.stop))
        ratio = checked_number("recompute_ratio", self.recompute_ratio, 0.0, 1.0, hint="0 = modular, 1 = full")
        set_(self, "recompute_ratio", ratio)
        if self.recompute_target is not None:
            set_(self, "recompute_target", checked_number("recompute_target", self.recompute_target, 0.0, 1.0,
                                                          hint="0 = modular, 1 = every deviating token"))
        set_(self, "cache_salt", checked_cache_salt(self.cache_salt))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise OptionTypeError(f"grammar must be None or a pc_rag.Grammar (Grammar.json_schema(...), ...), got "
                                  f"{_shown(self.grammar)}")
        set_(self, "n", checked_int("n", self.n, low=1, hint="replies to the prompt"))
        for name, value in zip(("logprobs", "presence_penalty", "frequency_penalty", "logit_bias"),
                               checked_token_options(self.logprobs, self.presence_penalty, self.frequency_penalty,
                                                     self.logit_bias), strict=True):
            set_(self, name, value)


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


def checked_token_options(logprobs, presence_penalty, frequency_penalty, logit_bias
                          ) -> tuple[int | None, float, float, tuple[tuple[int, float], ...]]:
    """logprobs, the two penalties and logit_bias, checked and normalised (GenerationOptions and decode.Sampling)."""
    if logprobs is not None:
        logprobs = checked_int("logprobs", logprobs, low=0, hint="how many most likely tokens, or None")
        if logprobs > MAX_TOP_LOGPROBS:
            raise OptionError(f"logprobs must be at most {MAX_TOP_LOGPROBS} (most likely tokens per step), got "
                              f"{logprobs}")
    penalties = [checked_number(name, value, -PENALTY_BOUND, PENALTY_BOUND, hint="0 = none")
                 for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty))]
    return (logprobs, *penalties, checked_logit_bias(logit_bias))


def checked_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """None, a mapping {token id: bias} or (id, bias) pairs, as sorted (id, bias) pairs; ids may be given as strings
    of digits (OpenAI's JSON keys)."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, (str, bytes)) or not isinstance(bias, Iterable):
        raise OptionTypeError(f"logit_bias must be None or a dict {{token id: bias}}, got {_shown(bias)}")
    else:
        items = list(bias)
    out: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise OptionTypeError(f"logit_bias must be a dict {{token id: bias}}, got the entry {_shown(item)}")
        token, value = item
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        token = checked_int(f"logit_bias key {token!r}", token, low=0, hint="a token id")
        out[token] = checked_number(f"logit_bias[{token}]", value, -LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND,
                                    hint="added to the token's logit; -100 bans it")
    return tuple(sorted(out.items()))


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


def checked_cache_salt(salt) -> str | None:
    """None, or a string of 1 to MAX_CACHE_SALT_CHARS characters that encodes as UTF-8 (it is hashed into keys)."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise OptionTypeError(f"cache_salt must be None or a string, got {_shown(salt)}")
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise OptionError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters (None: no namespace), got "
                          f"{len(salt)}")
    problem = unicode_problem(salt)
    if problem is not None:
        raise OptionError(f"cache_salt holds {problem}, which is not valid Unicode text")
    return salt


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
