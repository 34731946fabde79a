"""Choosing tokens and turning them into text: sampling, stop strings, streaming-safe detokenization."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers.decoders import DecodeStream

from .options import GenerationOptions, checked_sampling

_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 1.2e-38


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
    """Chooses one token from a [vocab] logits row; with a `grammar` (pc_rag.grammar.GrammarState), only among the
    tokens the grammar allows at this step, and the chosen token advances the grammar. One per request: both
    decode paths call it, so a batched row and a lone request are constrained alike."""

    def __init__(self, sampling: Sampling, grammar=None):
        self.sampling = sampling
        self.grammar = grammar
        # A CPU generator: the same seed gives the same tokens on CPU and CUDA (given the same logits).
        self.generator = torch.Generator()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        if self.grammar is None:
            return self._choose(logits)
        token = self._choose(self.grammar.mask(logits))
        self.grammar.accept(token)
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        s = self.sampling
        # Below float32's smallest normal number (1e-39, 5e-324: values a client may send) the distribution is
        # greedy's to the last bit, and dividing by it overflowed to inf and NaN probabilities.
        if s.temperature < _FLOAT32_TINY:
            return int(torch.argmax(logits))
        logits = logits.float().cpu()
        # Shifted so the largest is 0 before dividing: near that bound the unshifted quotients overflow (10 / 1e-38);
        # shifted, the others go to -inf, which softmax takes as 0.
        probs = torch.softmax((logits - logits.max()) / s.temperature, dim=-1)
        tokens = None  # the token id of each entry of probs, where that is not its index
        if s.top_p < 1.0:
            probs, tokens = _nucleus(probs, s.top_p)
        # One uniform draw from the request's generator through the distribution's CDF (in float64: 53 bits, so a
        # token's share of draws is its probability down to ~1e-16). torch.multinomial draws one exponential per
        # token of the vocabulary instead: 0.35 ms a row on an 8K vocabulary, 2.8 ms of each 8-request step of a
        # server, where sampling is what the OpenAI API does by default (bench model, 2026-12-03).
        cdf = probs.double().cumsum(-1)
        total = float(cdf[-1])
        if not 0 < total < float("inf"):  # NaN logits (a model that overflowed) fail this too: an error, no token
            raise RuntimeError(f"pc_rag: cannot sample from these logits (their probabilities sum to {total})")
        x = torch.rand(1, dtype=torch.float64, generator=self.generator) * total
        i = int(torch.searchsorted(cdf, x, right=True))  # the first entry whose CDF passes x: never one of p = 0
        if i == len(cdf):  # x rounded up to the total (u within 1e-16 of 1): the last possible entry
            i = int(probs.nonzero()[-1])
        return i if tokens is None else int(tokens[i])


# The nucleus is looked for among this many most likely tokens first: sorting the whole vocabulary cost ~1 ms a row
# (8K tokens), and a trained model's nucleus is usually far smaller.
NUCLEUS_CANDIDATES = 64


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches top_p (the token that crosses it included; the most
    likely one always, even for a top_p below float32's range): their probabilities, largest first, and token ids."""
    top, order = torch.topk(probs, min(NUCLEUS_CANDIDATES, probs.numel()))  # sorted, largest first
    if top.numel() < probs.numel() and float(top.sum()) < top_p:  # the nucleus is wider: the whole order
        top, order = torch.sort(probs, descending=True)
    n = max(1, int(((torch.cumsum(top, -1) - top) < top_p).sum()))  # a prefix: cumsum - p never decreases
    return top[:n], order[:n]


class TextStream:
    """Detokenizes incrementally and emits only text that can no longer change.

    Held back: a trailing incomplete UTF-8 sequence, and any tail that could be the start of a stop string. A
    stop string ends the stream; the text stops before it.

    Each token is decoded once, by the tokenizers library's `DecodeStream` (it keeps the few tokens a
    character or a word-piece prefix may still need), so a reply of n tokens costs O(n) decoding, not the
    O(n^2) of decoding the whole reply at every step. Tokenizers without a Rust backend fall back to that.
    """

    def __init__(self, tokenizer, stop: Sequence[str] | None):
        if isinstance(stop, str):
            stop = [stop]
        self.stop = [s for s in (stop or []) if s]
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self._decoded = ""  # complete text decoded so far (incremental path)

    def _decode(self) -> str:
        # No clean-up of spaces: it rewrites earlier text (" ." -> ".") once the next token arrives.
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self._decoded += piece
            full = self._decoded
        else:
            full = self._decode()
            if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence so far
                return ""
        hit = self._first_stop(full)
        if hit is not None:
            self.stopped = True
            return self._emit(full[:hit])
        return self._emit(full[: len(full) - self._stop_prefix_len(full)])

    def finish(self) -> str:
        """Flush what was held back (end of generation without a stop string)."""
        if self.stopped:
            return ""
        # One whole decode at the end: it also renders bytes the incremental decoder still holds (as U+FFFD).
        return self._emit(self._decode())

    def _emit(self, upto: str) -> str:
        n = len(self.text)
        if len(upto) <= n or upto[:n] != self.text:
            return ""
        new = upto[n:]
        self.text = upto
        return new

    def _first_stop(self, full: str) -> int | None:
        start = max(0, len(self.text) - self._longest_stop)
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
