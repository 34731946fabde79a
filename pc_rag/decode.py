"""Choosing tokens and turning them into text: sampling, stop strings, streaming-safe detokenization."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .options import GenerationOptions, checked_sampling


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        # The same checks and messages as GenerationOptions: a Sampling built by hand is checked too.
        for name, value in zip(("temperature", "top_p", "seed"),
                               checked_sampling(self.temperature, self.top_p, self.seed), strict=True):
            object.__setattr__(self, name, value)

    @classmethod
    def from_options(cls, options: GenerationOptions) -> Sampling:
        return cls(options.temperature, options.top_p, options.seed)


class Sampler:
    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        # A CPU generator: the same seed gives the same tokens on CPU and CUDA (given the same logits).
        self.generator = torch.Generator()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        s = self.sampling
        if s.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / s.temperature, dim=-1)
        if s.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest set whose mass reaches top_p (the token that crosses it included)
            drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= s.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextStream:
    """Detokenizes incrementally and emits only text that can no longer change.

    Held back: a trailing incomplete UTF-8 sequence (decoded as U+FFFD), and any tail that could be the
    start of a stop string. A stop string ends the stream; the text stops before it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] | None):
        if isinstance(stop, str):
            stop = [stop]
        self.stop = [s for s in (stop or []) if s]
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False

    def _decode(self) -> str:
        # No clean-up of spaces: it rewrites earlier text (" ." -> ".") once the next token arrives.
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self._decode()
        hit = self._first_stop(full)
        if hit is not None:
            self.stopped = True
            return self._emit(full[:hit])
        if full.endswith("\ufffd"):
            return ""
        return self._emit(full[: len(full) - self._stop_prefix_len(full)])

    def finish(self) -> str:
        """Flush what was held back (end of generation without a stop string)."""
        if self.stopped:
            return ""
        return self._emit(self._decode())

    def _emit(self, upto: str) -> str:
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return ""
        new = upto[len(self.text):]
        self.text = upto
        return new

    def _first_stop(self, full: str) -> int | None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        found = [i for s in self.stop if (i := full.find(s, start)) >= 0]
        return min(found) if found else None

    def _stop_prefix_len(self, full: str) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), best, -1):
                if full.endswith(s[:k]):
                    best = k
                    break
        return best
