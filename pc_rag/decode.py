"""Choosing tokens and turning them into text: sampling (penalties, logit bias, logprobs), stop strings,
streaming-safe detokenization."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers.decoders import DecodeStream

from .errors import OptionError
from .options import GenerationOptions, checked_sampling, checked_token_options

_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 1.2e-38


@dataclass(frozen=True)
class Sampling:
    """How a request's sampler chooses (GenerationOptions' sampling fields; the same checks)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # None: none recorded; k: the chosen token's and the k most likely

    def __post_init__(self):
        # The same checks and messages as GenerationOptions: a Sampling built by hand is checked too.
        for name, value in zip(("temperature", "top_p", "seed"),
                               checked_sampling(self.temperature, self.top_p, self.seed), strict=True):
            object.__setattr__(self, name, value)
        for name, value in zip(("logprobs", "presence_penalty", "frequency_penalty", "logit_bias"),
                               checked_token_options(self.logprobs, self.presence_penalty, self.frequency_penalty,
                                                     self.logit_bias), strict=True):
            object.__setattr__(self, name, value)

    @classmethod
    def from_options(cls, options: GenerationOptions, index: int = 0) -> Sampling:
        """The sampling of choice `index` of a request (n > 1): each choice its own seed, choice 0 the request's."""
        seed = options.seed if index == 0 or options.seed is None else choice_seed(options.seed, index)
        return cls(options.temperature, options.top_p, seed, options.presence_penalty, options.frequency_penalty,
                   options.logit_bias, options.logprobs)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` > 0 of a request seeded with `seed`: a hash of both, so that the choices differ and
    none equals the first choice of a request seeded `seed + index`."""
    digest = hashlib.blake2b(f"pc_rag choice {seed} {index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class Logprob:
    """A token at one step and its log-probability: its id, its own text, that text's bytes (a token that is part
    of a character has the bytes of its part, and U+FFFD in its text) and the natural log of its probability."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob(Logprob):
    """A generated token's `Logprob`, and the most likely tokens of its step, most likely first (`logprobs=k` asks
    for k of them; tokens a grammar forbids at that step are never among them)."""

    top: tuple[Logprob, ...] = ()


class Piece(str):
    """A piece of streamed text with what it completes: `logprobs`, the `TokenLogprob` of each token chosen since
    the previous piece (when logprobs were asked; a token whose text is held back, for a stop string or a split
    character, comes with the next piece, and what no piece carried is in the final `Generation`), and `choice`,
    the index of the reply it belongs to (n > 1). A `str`: code that reads text reads it as before (`choice`, not
    `index`, which would hide `str.index`)."""

    logprobs: tuple[TokenLogprob, ...] = ()
    choice: int = 0

    def __new__(cls, text: str = "", logprobs: Sequence[TokenLogprob] = (), choice: int = 0):
        piece = super().__new__(cls, text)
        piece.logprobs = tuple(logprobs)
        piece.choice = choice
        return piece


def choice_of(piece: str) -> int:
    """The choice a streamed piece belongs to (plain text: the first)."""
    return piece.choice if isinstance(piece, Piece) else 0


def joined(a: str, b: str) -> str:
    """Two consecutive pieces of one choice as one, of `a`'s type, their logprobs together."""
    if not isinstance(a, Piece) and not isinstance(b, Piece):
        return a + b
    cls = type(a) if isinstance(a, Piece) else type(b)
    return cls(str(a) + str(b), getattr(a, "logprobs", ()) + getattr(b, "logprobs", ()), choice_of(a))


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's `bytes_to_unicode`) mapped back to the bytes: printable bytes stand for
    themselves, the others for the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token's own text and bytes, as logprobs report them (cached). A token's bytes come from its vocabulary
    entry: byte-level BPE (Llama 3, Qwen, GPT-2; our test models) maps its characters back to bytes; SentencePiece
    (Llama 2, Mistral, Gemma) writes a space as U+2581 and a byte as <0xNN>; special tokens are their text.
    Decoding a token alone would lose the leading space SentencePiece's decoder strips from a text's start."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self._special |= set(getattr(tokenizer, "added_tokens_decoder", None) or {})
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        try:
            state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        except Exception:  # a decoder that does not say what it is: the SentencePiece rules, harmless elsewhere
            state = {}
        self._byte_level = _byte_level_chars() if '"ByteLevel"' in json.dumps(state) else None
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._text(token_id)
        return found

    def _text(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # beyond the tokenizer's vocabulary (a model whose head is wider)
            return "", b""
        if token_id in self._special:
            data = piece.encode()
        elif self._byte_level is not None and all(c in self._byte_level for c in piece):
            data = bytes(self._byte_level[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            data = bytes([int(piece[3:5], 16)])
        else:
            data = piece.replace("\u2581", " ").encode()
        return data.decode("utf-8", errors="replace"), data


class Sampler:
    """Chooses one token from a [vocab] logits row: `logit_bias` and the penalties added first, then, with a
    `grammar` (pc_rag.grammar.GrammarState), only among the tokens the grammar allows at this step (the chosen
    token advances the grammar). One per request (per choice, n > 1): both decode paths call it, so a batched row
    and a lone request are sampled alike, and what it records (each token's logprobs when asked, and when it was
    chosen) is the request's, whichever thread chose the token.

    `token_texts` (a `TokenTexts`) names the tokens of the logprobs; `choice` is the reply's index (n > 1)."""

    def __init__(self, sampling: Sampling, grammar=None, token_texts: TokenTexts | None = None, choice: int = 0):
        self.sampling = sampling
        self.grammar = grammar
        self.token_texts = token_texts
        self.choice = choice
        # A CPU generator: the same seed gives the same tokens on CPU and CUDA (given the same logits).
        self.generator = torch.Generator()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        else:
            self.generator.seed()
        self._counts: dict[int, int] = {}  # generated token -> times (the penalties)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per chosen token: (id, logprob, ((id, logprob) of the most likely)), as the decode step left them; made
        # into TokenLogprob on the request's thread, when asked for (`logprobs`).
        self._records: list[tuple[int, float, tuple[tuple[int, float], ...]]] = []
        self._logprobs: list[TokenLogprob] = []
        self._sent = 0  # tokens whose logprobs a piece carried
        self.times: list[float] = []  # time.perf_counter() when each token was chosen

    def __call__(self, logits: torch.Tensor) -> int:
        logits = self._adjusted(logits)
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        token = self._choose(logits)
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.sampling.logprobs is not None:
            self._record(logits, token)
        if self.sampling.penalized:
            self._counts[token] = self._counts.get(token, 0) + 1
        self.times.append(time.perf_counter())
        return token

    def judged(self, reason: str, cut: str | None = None) -> tuple[str, str | None]:
        """How the reply ended, as its grammar judges it: `reason` ("stop" for EOS or a stop string, "length"), or
        ("error", why) where the grammar could not be completed: it failed (a dead end, a limit of the grammar
        engine), or the reply stopped where the grammar does not accept it. `cut`: the text a stop string left, which
        the grammar must accept as it is (the matcher took the stop string's tokens too). A reply the token budget
        cut stays "length": more tokens could complete it."""
        grammar = self.grammar
        if grammar is None:
            return reason, None
        if cut is not None:
            if grammar.accepts(cut):
                return reason, None
            return "error", "a stop string ended the reply before its grammar was complete"
        if grammar.failure is not None:
            return "error", f"the grammar could not be completed: {grammar.failure}"
        if reason == "stop" and not grammar.complete:
            return "error", "the reply ended before its grammar was complete"
        return reason, None

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with OpenAI's logit bias and penalties: logit[j] += bias[j] - count[j] * frequency_penalty -
        (count[j] > 0) * presence_penalty, count[j] being how often the reply generated j so far. A copy: `logits`
        may be a row of the batched step's tensor."""
        s = self.sampling
        penalized = s.penalized and self._counts
        if not s.logit_bias and not penalized:
            return logits
        out = logits.to(torch.float32, copy=True)
        if s.logit_bias:
            if self._bias is None or self._bias[0].device != out.device:
                ids = [t for t, _ in s.logit_bias]
                if ids[-1] >= out.numel():  # sorted by id
                    raise OptionError(f"logit_bias names token {ids[-1]}, beyond the model's {out.numel()} tokens")
                self._bias = (torch.tensor(ids, device=out.device),
                              torch.tensor([b for _, b in s.logit_bias], dtype=torch.float32, device=out.device))
            out.index_add_(0, *self._bias)
        if penalized:
            ids = torch.tensor(list(self._counts), device=out.device)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32, device=out.device)
            out.index_add_(0, ids, -(counts * s.frequency_penalty + s.presence_penalty))
        return out

    def _record(self, logits: torch.Tensor, token: int) -> None:
        """The chosen token's log-probability and the most likely tokens', from the logits it was chosen from
        (temperature 1, no nucleus cut: the model's distribution as bias, penalties and grammar left it)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        k = self.sampling.logprobs
        if k:
            values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
            top = tuple((i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != float("-inf"))
        self._records.append((token, float(logprobs[token]), top))

    def logprobs(self, upto: int) -> tuple[TokenLogprob, ...] | None:
        """The TokenLogprob of the first `upto` tokens chosen (None when logprobs were not asked). The decode loop
        may have chosen one more than the request took (it computes ahead): `upto` is what the reply holds."""
        if self.sampling.logprobs is None:
            return None
        name = self.token_texts or (lambda i: ("", b""))
        for token, value, top in self._records[len(self._logprobs): upto]:
            self._logprobs.append(TokenLogprob(token, *name(token), value,
                                               tuple(Logprob(i, *name(i), v) for i, v in top)))
        return tuple(self._logprobs[:upto])

    def gaps(self, upto: int) -> tuple[float, ...]:
        """Seconds between each of the first `upto` tokens and the one before it (inter-token latency)."""
        times = self.times[:upto]
        return tuple(b - a for a, b in zip(times, times[1:], strict=False))

    def piece(self, text: str, upto: int) -> str:
        """`text`, the reply's next piece once its first `upto` tokens are out, as streamed: with logprobs asked or
        for a choice but the first, a `Piece` carrying the logprobs of the tokens since the last piece; otherwise
        `text` itself. An empty piece carries nothing (it is not streamed): its tokens go with the next."""
        if (self.sampling.logprobs is None and self.choice == 0) or not text:
            return text
        logprobs = self.logprobs(upto) or ()
        piece = Piece(text, logprobs[self._sent: upto], self.choice)
        self._sent = max(self._sent, upto)
        return piece

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
