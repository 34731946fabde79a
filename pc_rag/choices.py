"""A request's n replies (`n` > 1, OpenAI's `n`) from one prefill.

    prefill (Engine._prefill, once) -> each choice's first token sampled from the same logits, by its own sampler
    -> n - 1 more buffers get a copy of the prompt's slots (`copy_of_prompt`) -> n rows join the engine's decode
    loop (batch.py) -> their tokens, as they come, as pieces carrying their `choice` -> each choice's prefix
    blocks stored (`Assembler.save_prefix`: the prompt's once, each reply's own), buffers back to the pool.

What n choices cost beyond one: the prompt's KV copied n - 1 times (a memory copy, a small part of a prefill) and n
rows in each decode step (a step reads the weights once for all its rows). The rows always decode in the shared
loop, whatever `Engine.batch_decoding` says: decoding them one at a time would be n forwards a step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from dataclasses import dataclass, replace

from .assemble import Assembled
from .batch import decode_steps_needed
from .decode import TextStream, TokenLogprob
from .model import release_team
from .model.cache import SlotCache
from .options import GenerationOptions


@dataclass(frozen=True)
class Choice:
    """One reply of a request: `n` > 1 asks for several, decoded from one prefill (`Generation.choices`)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    logprobs: tuple[TokenLogprob, ...] | None = None  # as Generation.logprobs
    inter_token_s: tuple[float, ...] = ()  # as Generation.inter_token_s


@dataclass(frozen=True)
class ChoicesRun:
    """What `run_choices` did: the prefill's result (its prompt counts are the request's) and the replies."""

    asm: Assembled
    choices: tuple[Choice, ...]
    ttft_s: float
    total_s: float


def copy_of_prompt(runner, asm: Assembled) -> SlotCache:
    """A pooled buffer holding a copy of the prompt's KV (slots [0, prompt_tokens) of `asm.cache`), for one more
    choice to decode after."""
    cache = runner.acquire_cache(asm.cache.capacity)
    cache.hold(())  # whatever it held from its last request is overwritten below
    n = asm.prompt_tokens
    cache.keys[:, :, :, :n].copy_(asm.cache.keys[:, :, :, :n])
    cache.values[:, :, :, :n].copy_(asm.cache.values[:, :, :, :n])
    cache.length = n
    return cache


def run_choices(engine, prompt, options: GenerationOptions) -> Generator[str, None, ChoicesRun]:
    """The pieces of `options.n` replies to `prompt` (each a `decode.Piece` naming its `choice`, but plain text for
    choice 0 without logprobs), interleaved as their tokens come; returns what ran (`ChoicesRun`). The
    request is counted (`Engine._counted`) by the caller."""
    t0 = time.perf_counter()
    n, max_new_tokens = options.n, options.max_new_tokens
    samplers = [engine._sampler(options, i) for i in range(n)]
    with engine._prefill_turn if engine.batch_decoding else contextlib.nullcontext():
        asm = engine._prefill(prompt, options.mode, extra_capacity=max_new_tokens,
                              recompute_ratio=options.recompute_ratio, namespace=options.cache_salt)
    caches = [asm.cache]
    texts = [TextStream(engine.tokenizer, options.stop) for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    finish = ["length"] * n
    rows = []
    done = False
    ttft = total = 0.0
    try:
        tokens = [sampler(asm.logits) for sampler in samplers]  # one prefill's logits, n samplers
        ttft = time.perf_counter() - t0
        caches += [copy_of_prompt(engine.runner, asm) for _ in range(n - 1)]
        room = engine.runner.shape.max_positions - 1 - asm.last_position  # positions left for new tokens
        needed = decode_steps_needed(max_new_tokens, room)
        rows = [engine._join_batch(caches[i], samplers[i], [tokens[i]], [asm.last_position + 1], asm.prompt_tokens,
                                   needed) for i in range(n)]
        live = list(range(n))
        for step in range(max_new_tokens):
            for i in list(live):
                ids[i].append(tokens[i])
                text, sampler = texts[i], samplers[i]
                if tokens[i] in engine.eos_ids:
                    finish[i] = "stop"
                    yield sampler.piece(text.finish(), len(ids[i]))
                    live.remove(i)
                    continue
                yield sampler.piece(text.push(tokens[i]), len(ids[i]))
                if text.stopped:
                    finish[i] = "stop"
                    live.remove(i)
                    rows[i].close()  # leaves the batch at the next step; the others go on
                elif step + 1 == max_new_tokens or step + 1 > room:
                    yield sampler.piece(text.finish(), len(ids[i]))
                    live.remove(i)
            if not live:
                break
            for i in live:
                tokens[i] = rows[i].next()
        done = True
    finally:  # also when the stream is abandoned: rows leave the batch, buffers return to the pool
        total = time.perf_counter() - t0
        try:
            for row in rows:
                row.close()
            # Each choice's reply continues the prompt in its own buffer: the prompt's blocks are stored once (the
            # first choice's call), each reply's own blocks from its buffer.
            saved: frozenset[str] = frozenset()
            for i in range(n):
                if ids[i]:
                    saved |= engine.assembler.save_prefix(asm if i == 0 else replace(asm, cache=caches[i]),
                                                          ids[i][:-1], skip=saved)
                    engine._remember_reply(prompt, texts[i].text, ids[i], asm if done and i == 0 else None, saved,
                                           options.cache_salt)
            if any(ids):
                engine._remember_passages(asm.plan)
        finally:
            for cache in caches:
                engine.runner.release_cache(cache)
            release_team()
    choices = tuple(Choice(i, texts[i].text, tuple(ids[i]), finish[i], samplers[i].logprobs(len(ids[i])),
                           samplers[i].gaps(len(ids[i]))) for i in range(n))
    return ChoicesRun(asm, choices, ttft, total)
