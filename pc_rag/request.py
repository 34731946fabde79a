"""One request's life, in the order it runs (`Request.run`):

    plan      the prompt as token segments (segments.py, text_index.py), then where each slot's KV comes from,
              from the store's answers (plan.py)
    prefill   encode the misses, build the cache, forward the fresh slots (assemble.py): the first logits, or, while
              other requests decode, the prompt's last tokens left to the shared decode step
    decode    each reply's tokens, alone on this thread or as rows of the engine's shared step (batch.py); `n`
              replies decode from one prefill, each from a copy of the prompt's KV
    finish    once the reply is out: what it leaves for the next requests (after_reply.py), buffers back to the pool
    leftovers once its Generation is out (the caller asks for more: a collected `generate`, a server's stream after
              its last event): the prompt's new passages encoded in one batched pass, outside the request and only
              while no request runs, stopped within a layer by one that arrives (after_reply.encode_passages)

The engine holds what requests share (the model runner, the store, the indexes, the decode loop); a Request holds
what is its own: its options (the cache namespace among them), samplers, buffers and text streams.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from . import after_reply
from .align import ape_for
from .assemble import Assembled, Recompute
from .batch import RowTokens, decode_steps_needed
from .decode import Sampler, Sampling, TextStream, TokenLogprob, TokenTexts
from .errors import PromptError
from .model import release_team, releasing_team
from .model.cache import SlotCache
from .options import MODES, GenerationOptions
from .plan import REUSING_CHUNKS, Plan, Wanted
from .pml import PML
from .segments import Prompt, TokenSegment


@dataclass(frozen=True)
class SegmentSource:
    """Where one piece of the prompt's KV came from, in prompt order."""

    kind: str  # "bos" | "text" | "sep" | "chunk" | "passage" | "scaffold" (a declared group) | "prefix"
    tokens: int
    source: str  # "fresh" | "prefix" | "chunk" | "scaffold" (plan.Source)
    origin: str | None  # store tier that served it, "computed" when this request encoded it, None if fresh


@dataclass(frozen=True)
class Choice:
    """One reply of a request: `n` > 1 asks for several, decoded from one prefill (`Generation.choices`)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # as Generation.finish_reason
    logprobs: tuple[TokenLogprob, ...] | None = None  # as Generation.logprobs
    inter_token_s: tuple[float, ...] = ()  # as Generation.inter_token_s
    error: str | None = None  # as Generation.error


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: tuple[int, ...]
    mode: str
    # "stop" (EOS or a stop string; under a grammar, only where the grammar accepts the reply) | "length" (the
    # token budget or the context's end) | "error" (its grammar could not be completed: `error` says why)
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int  # KV reused from the store (cached_tokens + computed_tokens == prompt_tokens)
    computed_tokens: int
    stored_tokens: int  # prompt tokens whose KV this request newly stored (chunks it encoded, prefix blocks)
    recomputed_tokens: int  # blend: reused chunk tokens recomputed in context (part of computed_tokens)
    ttft_s: float  # from the call to the first token chosen: tokenize, look up, load, relocate, forward
    total_s: float
    sources: tuple[SegmentSource, ...]
    prompt_ids: tuple[int, ...]  # the prompt's token ids, as the model saw them
    # The plan the request carried out: what `explain` showed just before, for a request without faults; what
    # changed while it ran (a block lost between lookup and read) is in `plan.events`.
    plan: Plan | None = field(default=None, repr=False, compare=False)
    # `logprobs=k`: each generated token's log-probability and the k most likely tokens of its step (decode.py:
    # TokenLogprob); None when not asked.
    logprobs: tuple[TokenLogprob, ...] | None = None
    inter_token_s: tuple[float, ...] = ()  # seconds between each generated token and the one before it
    # Every reply of the request, choices[0] being this one's text, token_ids, finish_reason and logprobs (n > 1
    # asks for more; the prompt's counts and times above are the request's, shared by its choices).
    choices: tuple[Choice, ...] = ()
    # blend: the mean relative key deviation of the reused chunk tokens its probe measured (layer 1), None without
    # a probe; what it recomputed is `recomputed_tokens`.
    deviation: float | None = None
    # finish_reason "error": why the reply could not be completed (its grammar reached a dead end or one of the
    # grammar engine's limits; a stop string cut it before the grammar accepted it); None otherwise.
    error: str | None = None

    def __post_init__(self):
        if not self.choices:
            object.__setattr__(self, "choices", (Choice(0, self.text, self.token_ids, self.finish_reason,
                                                        self.logprobs, self.inter_token_s, self.error),))

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, over every choice."""
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / (self.total_s - self.ttft_s) if n > 0 and self.total_s > self.ttft_s else float("nan")


# ---- plan and prefill (also what `Engine.explain` and `Engine.next_token_logits` run) ---------------------------
def prompt_segments(engine, prompt: Prompt | str | PML, mode: str, namespace: str | None = None,
                    extra_capacity: int = 0) -> tuple[list[TokenSegment], int]:
    """The prompt's token segments, checked against the model's context, and the extra capacity its decoding can
    use (bounded by the positions left: max_new_tokens=10**9 would otherwise ask for a billion-token buffer)."""
    if mode not in MODES:
        raise PromptError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if isinstance(prompt, PML):
        prompt = engine.schemas.segments(prompt.text)
    elif isinstance(prompt, str):
        prompt = engine.split(prompt, cache_salt=namespace)
    segments = engine.segmenter.segments(prompt, namespace)
    last = max(s.end for s in segments)
    positions = engine.runner.shape.max_positions
    if last > positions:
        raise PromptError(f"the prompt needs position ids up to {last}, beyond the model's context of {positions} "
                          f"tokens: drop chunks or shorten the text")
    return segments, min(extra_capacity, positions - segments[-1].end)


def prefill(engine, prompt, options: GenerationOptions, extra_capacity: int = 0, defer: int = 0) -> Assembled:
    """Plan, then carry it out (`Assembler.assemble`): the first logits. `options` is the request's context: its
    mode, its cache namespace (`cache_salt`: every key is in it) and, for blend, `recompute_ratio` of the reused
    chunk tokens recomputed, or what `recompute_target` (else the engine's) asks (assemble.Recompute). Lookups
    keep what the store answered, so the store is asked once."""
    mode, namespace = options.mode, options.cache_salt
    segments, extra_capacity = prompt_segments(engine, prompt, mode, namespace, extra_capacity)
    if mode in REUSING_CHUNKS:  # refused (UnsupportedModelError) where relocated keys would be wrong
        engine.runner.check_relocation()
        engine.check_quality(mode)  # and modular where the gate measured it too far from full (min_agreement)
    lookups = engine.assembler.lookups()
    ape = ape_for(engine) if options.align == "ape" else None
    plan = engine.planner.plan(segments, mode, lookups, namespace, engine.passages_from_first_sight, ape)
    if mode in REUSING_CHUNKS:
        engine.scaffolds.observe(segments, namespace)
    recompute = None
    if mode == "blend":
        target = options.recompute_target if options.recompute_target is not None else engine.recompute_target
        recompute = Recompute(options.recompute_ratio, engine.blend_selection, target,
                              engine.deviation_reference() if target is not None else 1.0)
    return engine.assembler.assemble(plan, lookups.blocks, extra_capacity, recompute, defer)


@releasing_team
def next_token_logits(engine, prompt, options: GenerationOptions):
    """`Engine.next_token_logits`: a request that stops at the first logits, leaving its prefix blocks behind."""
    with engine.traffic.counted():
        asm = prefill(engine, prompt, options)
        try:
            engine.assembler.save_prefix(asm)
        finally:
            engine.runner.release_cache(asm.cache)
        left = after_reply.remember_passages(engine, asm.plan)
    after_reply.encode_passages(engine, left)
    return asm.logits


class Request:
    """One call of `Engine.generate`/`stream`: its options, and, as it runs, its buffers and replies. The prompt is
    `run`'s argument, passed down the steps that read it (planning, then what the reply leaves behind)."""

    def __init__(self, engine, options: GenerationOptions):
        self.engine = engine
        self.options = options
        self.samplers = [self._sampler(i) for i in range(options.n)]
        self.texts = [TextStream(engine.tokenizer, options.stop) for _ in range(options.n)]
        self.ids: list[list[int]] = [[] for _ in range(options.n)]
        self.finish = ["length"] * options.n
        self.errors: list[str | None] = [None] * options.n  # why a reply could not be completed (finish "error")
        self.ended = [False] * options.n
        self.caches: list[SlotCache] = []
        self.rows: list[RowTokens | None] = [None] * options.n
        self.ttft_s = 0.0
        self.left: list[Wanted] = []  # the passages `finish` leaves to the leftovers stage

    def run(self, prompt) -> Generator[str | Generation, None, None]:
        """The text pieces as they are decoded (`decode.Piece`s naming their choice where it matters), then the
        `Generation`; asked for more, the leftovers run (the map above). Closing it early (an abandoned stream) still
        runs `finish`; closed at the Generation, it leaves no leftovers (its passages are encoded at their next
        sight)."""
        t0 = time.perf_counter()
        with self.engine.traffic.counted():
            asm = self._prefill(prompt)
            done = False
            try:
                yield from self._decode(asm, t0)
                done = True
            finally:
                total = time.perf_counter() - t0
                self._finish(prompt, asm, done)
        yield self._generation(asm, total)
        after_reply.encode_passages(self.engine, self.left)

    def _sampler(self, choice: int) -> Sampler:
        """Reply `choice`'s sampler: its grammar state, its seed, the token names of logprobs."""
        engine, options = self.engine, self.options
        grammar = engine.grammars.state(options.grammar) if options.grammar is not None else None
        texts = None
        if options.logprobs is not None:
            texts = engine.token_texts = getattr(engine, "token_texts", None) or TokenTexts(engine.tokenizer)
        return Sampler(Sampling.from_options(options, choice), grammar, texts, choice)

    def _prefill(self, prompt) -> Assembled:
        """One prefill at a time, in arrival order (batch.py). While other requests decode, a prompt whose tokens to
        compute are its last ones (a question after cached chunks, a chat turn), at most a chunk of them, leaves them
        to the shared decode step as one more row: its first token costs a share of a batched step instead of a
        forward of its own (docs/speed.md#batching-and-concurrent-streams); not when the batch is full, where the
        first token would wait for a row to leave, nor for several replies."""
        engine, options = self.engine, self.options
        decoder = engine.traffic.decoder(create=False)
        defer = (engine.runner.prefill_chunk_tokens if options.n == 1 and engine.traffic.shares_steps()
                 and (decoder is None or decoder.has_room()) else 0)
        with engine.traffic.prefill_turn:
            return prefill(engine, prompt, options, options.max_new_tokens, defer)

    def _first_tokens(self, asm: Assembled, steps: int) -> list[int]:
        """Each reply's first token: sampled from the prefill's logits, or chosen by the shared step that computes
        the prompt's deferred tail (EOS as the last prompt token: the loop takes no row after it, computed here)."""
        engine = self.engine
        tail = range(asm.prompt_tokens - asm.deferred, asm.prompt_tokens)
        ids, positions = [asm.plan.ids[s] for s in tail], [asm.plan.positions[s] for s in tail]
        if asm.deferred and ids[-1] in engine.eos_ids:
            asm.cache.length = asm.prompt_tokens
            asm = replace(asm, logits=engine.runner.forward(asm.cache, ids, positions, list(tail)))
        if asm.logits is None:
            self.rows[0] = engine.traffic.join(asm.cache, self.samplers[0], ids, positions, tail.start, steps + 1,
                                             prompt=True)
            return [self.rows[0].next()]
        return [sampler(asm.logits) for sampler in self.samplers]

    def _decode(self, asm: Assembled, t0: float) -> Generator[str, None, None]:
        engine, max_new_tokens = self.engine, self.options.max_new_tokens
        room = engine.runner.shape.max_positions - 1 - asm.last_position  # positions left for new tokens
        steps = decode_steps_needed(max_new_tokens, room)
        self.caches = [asm.cache]
        tokens = self._first_tokens(asm, steps)
        self.ttft_s = time.perf_counter() - t0
        self.caches += [engine.runner.copy_cache(asm.cache, asm.prompt_tokens) for _ in range(self.options.n - 1)]
        # Several replies always decode as rows of the shared step (one forward a step for all of them); one does
        # too while other requests decode.
        if self.rows[0] is None and (self.options.n > 1 or engine.traffic.shares_steps()):
            self.rows = [engine.traffic.join(cache, sampler, [token], [asm.last_position + 1], asm.prompt_tokens, steps)
                         for cache, sampler, token in zip(self.caches, self.samplers, tokens, strict=True)]
        live = list(range(self.options.n))
        for step in range(max_new_tokens):
            for i in list(live):
                yield from self._take(i, tokens[i], last=step + 1 == max_new_tokens or step + 1 > room)
                if self.ended[i]:
                    live.remove(i)
            if not live:
                return
            for i in live:
                tokens[i] = self._next(i, asm, tokens[i], step, steps)

    def _take(self, i: int, token: int, last: bool) -> list[str]:
        """Reply `i`'s `token` as text pieces; ends the reply at EOS, a stop string or its last token, with the finish
        reason its grammar judges (`Sampler.judged`: "error" where a grammar could not be completed)."""
        ids, text, sampler = self.ids[i], self.texts[i], self.samplers[i]
        ids.append(token)
        if token in self.engine.eos_ids:
            self.ended[i] = True
            self.finish[i], self.errors[i] = sampler.judged("stop")
            return [sampler.piece(text.finish(), len(ids))]
        pieces = [sampler.piece(text.push(token), len(ids))]
        if text.stopped:
            self.ended[i] = True
            self.finish[i], self.errors[i] = sampler.judged("stop", cut=text.text)
            if self.rows[i] is not None:
                self.rows[i].close()  # leaves the batch at the next step; the other replies go on
        elif last:
            self.ended[i] = True
            self.finish[i], self.errors[i] = sampler.judged("length")
            pieces.append(sampler.piece(text.finish(), len(ids)))
        return pieces

    def _next(self, i: int, asm: Assembled, token: int, step: int, steps: int) -> int:
        """Reply `i`'s next token: from its row of the shared step, or by a forward of its own, joining the shared
        step as soon as another request decodes."""
        if self.rows[i] is not None:
            return self.rows[i].next()
        engine, sampler = self.engine, self.samplers[i]
        pos, slot = asm.last_position + 1 + step, asm.prompt_tokens + step
        nxt = sampler(engine.runner.forward(asm.cache, [token], [pos], [slot]))
        if engine.traffic.shares_steps():
            self.rows[i] = engine.traffic.join(asm.cache, sampler, [nxt], [pos + 1], slot + 1, steps - step - 1)
        return nxt

    def _finish(self, prompt, asm: Assembled, done: bool) -> None:
        """Rows leave the batch first (the decode loop no longer writes the buffers), then what the request leaves
        for the next ones is saved, then the buffers go back to the pool."""
        engine = self.engine
        try:
            for row in self.rows:
                if row is not None:
                    row.close()
            replies = [(asm if i == 0 else replace(asm, cache=cache), self.texts[i].text, self.ids[i])
                       for i, cache in enumerate(self.caches or [asm.cache])]
            self.left = after_reply.save(engine, prompt, asm, replies, done, self.options.cache_salt)
        finally:
            for cache in self.caches or [asm.cache]:
                engine.runner.release_cache(cache)
            release_team()  # a server's request thread waits for its next request (pc_rag/model/threads.py)

    def _generation(self, asm: Assembled, total_s: float) -> Generation:
        choices = tuple(Choice(i, self.texts[i].text, tuple(self.ids[i]), self.finish[i],
                               self.samplers[i].logprobs(len(self.ids[i])), self.samplers[i].gaps(len(self.ids[i])),
                               self.errors[i])
                        for i in range(self.options.n))
        first = choices[0]
        return Generation(
            text=first.text, token_ids=first.token_ids, mode=self.options.mode, finish_reason=first.finish_reason,
            prompt_tokens=asm.prompt_tokens, cached_tokens=asm.cached_tokens, computed_tokens=asm.computed_tokens,
            stored_tokens=asm.plan.as_built().stored_tokens, recomputed_tokens=asm.recomputed_tokens,
            ttft_s=self.ttft_s, total_s=total_s,
            sources=tuple(SegmentSource(p.kind, p.n, p.source, p.origin) for p in asm.pieces),
            prompt_ids=asm.plan.ids, plan=asm.plan, logprobs=first.logprobs, inter_token_s=first.inter_token_s,
            choices=choices, deviation=asm.deviation, error=first.error)
