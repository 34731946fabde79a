"""Continuous batching: requests that decode at the same time share one forward pass per step.

    request thread: prefill (its own SlotCache, Engine._prefill) -> first token -> `BatchDecoder.join`
                    -> `RowTokens.next()` per token -> `close()` -> prefix blocks stored, buffer released
    decode thread:  admit the requests that joined, one `step` over every active request's last token
                    (`LlamaRunner.step`: one pass through the weights for all of them, each attending to its
                    own buffer), sample each row with that request's own Sampler, hand each token to its
                    request's queue, drop requests that are done (EOS, no steps left, closed)

A request may also join before its first token, with the rest of its prompt (a question after cached chunks, a
chat turn; the engine hands over at most a prefill chunk) as its row's tokens for the first step it is in; that
step computes them in one forward with the other newcomers' (`LlamaRunner.forward_rows`; the decoding rows take
their usual step beside it) and chooses its first token. A burst of new questions then costs a step or two
where it cost a forward per question between steps (docs/speed.md#batching-and-concurrent-streams).

A request joins or leaves between steps, never during one. Its KV stays in its own buffer: the step writes
each new token's KV straight into the slot after the request's last one, so joining and leaving copy
nothing, and `save_prefix` finds the reply's KV where the one-at-a-time loop left it.

Plain Python over a `step` function: the scheduler is tested with a fake step, no model needed.

Fairness between prefill and decode. Forward passes take turns on the runner's `TurnLock` (first come,
first served), and while requests decode a long prefill runs as several forwards of at most
`model.PREFILL_CHUNK_TOKENS` fresh tokens each, so a newcomer's prefill stalls the decoding requests for one
chunk at a time, not for the whole prompt. The engine lets one request prefill at a time
(`Traffic.prefill_turn`, also a TurnLock): with every prefill advancing together, a burst of 16 requests would
all get their first token only once the 16th prefill was done; one at a time, in arrival order, the first
answers after one prefill.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("pc_rag")

# Requests decoded in one forward pass. Each step reads every weight once for the whole batch, so on a
# memory-bound CPU a step over 8 rows cost 1.6x one over a single row (bench model, README "Serving"); past
# 16 the per-row attention, which is not shared, grows and each stream's own rate falls below half of a
# lone stream's. Requests beyond it wait (holding their prefilled buffer) and join as rows leave.
MAX_BATCH = 16

# The most prompt tokens the newcomers of one step bring (the first newcomer always comes in). The same bound as
# a prefill's chunk while others decode (model.PREFILL_CHUNK_TOKENS), and the engine hands the loop no longer
# rest of a prompt: the decoding rows wait for at most about one chunk's forward.
MAX_STEP_TOKENS = 512

# How long the decode thread waits for a newcomer once nothing decodes, before it exits (the next request
# starts a new one). Starting a thread per burst was cheap in time, but a server whose batch emptied between
# requests (a new decode thread every few requests) grew its resident memory by ~4 KiB per request more than
# with one long-lived thread (measured over 3,000 requests; the allocator's doing, not traced further). While
# it idles it holds no OpenMP team (`on_idle`), which would slow a lone request decoding on its own thread.
# A lone request never starts it, so only bursts of concurrent requests do.
IDLE_EXIT_S = 2.0


class TurnLock:
    """A lock granted in the order it was asked for.

    `threading.Lock` is not fair: a thread that releases it and asks again at once (a prefill running its
    chunks back to back) can take it again ahead of a thread that has been waiting (the decode loop), which
    would then stall for the whole prompt. Tickets make the waiters take turns.
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket whose holder may run
        self._abandoned: set[int] = set()  # tickets whose waiter gave up (an exception while waiting)

    def __enter__(self) -> TurnLock:
        with self._cond:
            ticket = self._next
            self._next += 1
            try:
                while ticket != self._serving:
                    self._cond.wait()
            except BaseException:  # never leave a ticket that nobody will serve: every later one would hang
                self._abandoned.add(ticket)
                raise
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            while self._serving in self._abandoned:
                self._abandoned.discard(self._serving)
                self._serving += 1
            self._cond.notify_all()


_END = object()  # put in a request's queue when its row leaves: a read past the last token fails, never hangs


@dataclass(eq=False)
class _Row:
    """One decoding request, as the decode loop sees it."""

    cache: Any  # the request's own SlotCache
    sampler: Callable[[Any], int]  # [vocab] logits -> token id (its own generator: seeds hold under batching)
    feed: list[int]  # the tokens the next step feeds: the last token chosen (or the rest of the prompt)
    positions: list[int]  # their position ids
    slot: int  # the buffer slot the first one's KV is written to, the others' after it
    steps_left: int  # forward passes still allowed (max_new_tokens and the model's context)
    prompt: bool  # feed holds the prompt's last tokens: the next step chooses the request's first token
    tokens: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # ints, then _END (or an exception)
    left: threading.Event = field(default_factory=threading.Event)  # set once the loop no longer touches it
    cancelled: bool = False


class RowTokens:
    """The tokens one request's row produces, in order (what the request's thread holds)."""

    def __init__(self, decoder: BatchDecoder | None, row: _Row | None):
        self._decoder, self._row = decoder, row

    def next(self) -> int:
        """The next token; blocks until the decode loop has computed it. Re-raises a failed step's error."""
        if self._row is None:
            raise RuntimeError("pc_rag: this request has no decode steps left")
        item = self._row.tokens.get()
        if item is _END:
            self._row.tokens.put(_END)
            raise RuntimeError("pc_rag: read past the last decode step of a request")
        if isinstance(item, BaseException):
            self._row.tokens.put(_END)
            raise item
        return item

    def close(self) -> None:
        """Leave the batch (at the next step boundary) and wait until the loop no longer writes the buffer,
        so the caller may store its blocks and return it to the pool. Idempotent."""
        if self._row is not None:
            self._decoder._cancel(self._row)


class BatchDecoder:
    """The decode loop shared by all of an engine's requests; a background thread runs while any decodes.

    `step(caches, tokens, positions, slots)` runs one forward pass for B requests (request b's tokens[b] at its
    positions[b], their KV written from slot slots[b] on in its own cache, attending to that cache only) and
    returns [B, vocab] logits of each request's last token.
    """

    def __init__(self, step: Callable[[list, list[list[int]], list[list[int]], list[int]], Any],
                 eos_ids: frozenset[int], max_batch: int = MAX_BATCH, on_idle: Callable[[], None] = lambda: None,
                 max_step_tokens: int = MAX_STEP_TOKENS):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._step = step
        self._on_idle = on_idle  # called on the loop's thread once nothing decodes (the engine frees its OpenMP team)
        self.eos_ids = eos_ids
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # notified when a request joins
        self.idle_exit_s = IDLE_EXIT_S
        self._waiting: list[_Row] = []  # joined, not yet in a step (beyond max_batch, or arrived mid-step)
        self._active: list[_Row] = []
        self._thread: threading.Thread | None = None
        # Counters (read by Engine.stats): forward passes, tokens they produced, the largest batch seen.
        self.steps = 0
        self.tokens = 0
        self.max_batch_seen = 0
        self.first_tokens = 0  # of those tokens, requests' first (chosen after their prompt's last tokens)
        self.prompt_tokens = 0  # prompt tokens the steps computed

    def join(self, cache, sampler: Callable[[Any], int], tokens: list[int], positions: list[int], slot: int,
             steps: int, prompt: bool = False) -> RowTokens:
        """Decode after `tokens` (at `positions`, their KV to go to slots from `slot` on) for at most `steps` more
        tokens, stopping after an EOS token. `tokens`: the request's first token, chosen after its prompt, or with
        `prompt` the prompt's last tokens, still to compute (the first step chooses the first token)."""
        if len(tokens) != len(positions) or not tokens:
            raise ValueError(f"a row needs one position per token, got {len(tokens)} tokens, {len(positions)} "
                             "positions")
        if steps <= 0 or tokens[-1] in self.eos_ids:
            return RowTokens(None, None)
        row = _Row(cache, sampler, list(tokens), list(positions), slot, steps, prompt)
        with self._lock:
            self._waiting.append(row)
            if self._thread is None:  # the loop exits after idling; a newcomer starts it again
                self._thread = threading.Thread(target=self._loop, name="pc_rag-decode", daemon=True)
                self._thread.start()
            self._wake.notify()
        return RowTokens(self, row)

    def busy(self) -> bool:
        """Whether any request is decoding or waiting for a row (no lock: a momentary answer is enough)."""
        return bool(self._active or self._waiting)

    def has_room(self) -> bool:
        """Whether a request joining now would be in the next step, not wait for a row to leave (no lock)."""
        return len(self._active) + len(self._waiting) < self.max_batch

    def stats(self) -> dict:
        with self._lock:
            return {"active": len(self._active), "waiting": len(self._waiting), "steps": self.steps,
                    "tokens": self.tokens, "max_batch": self.max_batch, "max_batch_seen": self.max_batch_seen,
                    "first_tokens": self.first_tokens, "prompt_tokens": self.prompt_tokens}

    # ---- the loop (its own thread) ----------------------------------------------------------------------
    def _cancel(self, row: _Row) -> None:
        with self._lock:
            row.cancelled = True
            if row in self._waiting:  # never stepped: nothing to wait for
                self._waiting.remove(row)
                self._leave(row)
            waits = self._thread is not threading.current_thread()
        if waits:
            row.left.wait()

    def _leave(self, row: _Row) -> None:  # with self._lock held
        row.tokens.put(_END)
        row.left.set()

    def _admit(self) -> list[_Row]:
        """The rows of the next step (with self._lock held): closed ones dropped, waiting ones admitted."""
        for row in [r for r in self._active if r.cancelled]:
            self._active.remove(row)
            self._leave(row)
        fed = 0  # the newcomers' tokens: the first always comes in, the next while they stay within the bound
        while self._waiting and len(self._active) < self.max_batch:
            if fed and fed + len(self._waiting[0].feed) > self.max_step_tokens:
                break  # in arrival order: a long newcomer is not overtaken, it comes first in the next step
            fed += len(self._waiting[0].feed)
            self._active.append(self._waiting.pop(0))
        return list(self._active)

    def _loop(self) -> None:
        while True:
            with self._lock:
                batch = self._admit()
            if not batch:
                try:
                    self._on_idle()
                except Exception:  # the loop must go on: a dead loop would leave the next joiners waiting
                    log.exception("pc_rag: the decode loop's idle hook failed")
                with self._lock:
                    batch = self._admit()
                    if not batch:
                        self._wake.wait(self.idle_exit_s)
                        batch = self._admit()
                        if not batch:
                            self._thread = None
                            return
            try:
                logits = self._step([r.cache for r in batch], [r.feed for r in batch],
                                    [r.positions for r in batch], [r.slot for r in batch])
                chosen = [r.sampler(logits[b]) for b, r in enumerate(batch)]
            except BaseException as error:  # every request of the failed step gets the error; the loop goes on
                log.exception("pc_rag: a batched decode step over %d requests failed", len(batch))
                with self._lock:
                    for row in batch:
                        row.tokens.put(error)
                        self._active.remove(row)
                        self._leave(row)
                continue
            done = []
            for row, token in zip(batch, chosen, strict=True):
                row.tokens.put(token)
                if row.prompt:
                    self.first_tokens += 1
                    self.prompt_tokens += len(row.feed)
                    row.prompt = False
                row.slot += len(row.feed)
                row.feed, row.positions = [token], [row.positions[-1] + 1]
                row.steps_left -= 1
                if row.steps_left == 0 or token in self.eos_ids:
                    done.append(row)
            with self._lock:
                self.steps += 1
                self.tokens += len(batch)
                self.max_batch_seen = max(self.max_batch_seen, len(batch))
                for row in done:
                    self._active.remove(row)
                    self._leave(row)


class Traffic:
    """What an engine's requests share while they run: how many run now, the one-prefill-at-a-time turn, and the
    decode loop they join (built on the first batched request by `make_decoder`, which reads `max_batch` then)."""

    def __init__(self, make_decoder: Callable[[], BatchDecoder], release_team: Callable[[], None]):
        self._make_decoder, self._release_team = make_decoder, release_team
        self._decoder: BatchDecoder | None = None
        self._decoder_lock = threading.Lock()
        self.running = 0  # requests between the start of their prefill and their last token (`counted`)
        self._running_lock = threading.Lock()
        # One prefill at a time, in arrival order (module docstring: a burst's first request answers after one).
        self.prefill_turn = TurnLock()

    @contextlib.contextmanager
    def counted(self):
        """While inside, a request is running (between the start of its prefill and its last token)."""
        with self._running_lock:
            self.running += 1
        try:
            yield
        finally:
            with self._running_lock:
                self.running -= 1

    def busy(self) -> bool:
        """Whether a request other than the caller's (which is counted) is running."""
        return self.running > 1

    def idle(self) -> bool:
        """Whether no request is running (asked by work outside any request: a reply's leftovers)."""
        return self.running == 0

    def arrival(self, mine: int = 0) -> Arrival:
        """A flag set while more requests run than the caller's `mine` (0 outside a request, 1 inside one): what
        speculative work stops for (`LlamaRunner.cancellable`), within a layer of the forward it is in."""
        return Arrival(self, mine)

    def shares_steps(self) -> bool:
        """Whether a request decodes as a row of the shared step: when others run. One alone decodes on its own
        thread: with the loop's thread computing too, two threads hold OpenMP teams, and on 2 cores every
        parallel op then paid a wake-up (a lone decode ran at 65-70% of its speed, bench model)."""
        return self.busy()

    def decoder(self, create: bool = True) -> BatchDecoder | None:
        with self._decoder_lock:
            if self._decoder is None and create:
                self._decoder = self._make_decoder()
            return self._decoder

    def join(self, cache, sampler, tokens: list[int], positions: list[int], slot: int, steps: int,
             prompt: bool = False) -> RowTokens:
        """A request's row in the shared decode loop, after `tokens` (at `positions`, their KV to go to slots from
        `slot` on: the first token chosen, or the prompt's tokens left to compute), for at most `steps` more
        forward passes. The loop starts computing the next token now, while this thread hands out the first."""
        joined = self.decoder().join(cache, sampler, tokens, positions, slot, steps, prompt)
        self._release_team()  # this thread now waits for the loop's tokens (pc_rag/model/threads.py)
        return joined

    def stats(self, max_batch: int) -> dict:
        decoder = self._decoder
        if decoder is not None:
            return decoder.stats()
        return {"active": 0, "waiting": 0, "steps": 0, "tokens": 0, "max_batch": max_batch, "max_batch_seen": 0,
                "first_tokens": 0, "prompt_tokens": 0}


class Arrival:
    """`Traffic.arrival`: an Event-like flag (`is_set`) read at every layer of a cancellable forward."""

    def __init__(self, traffic: Traffic, mine: int):
        self._traffic, self._mine = traffic, mine

    def is_set(self) -> bool:
        return self._traffic.running > self._mine


def decode_steps_needed(max_new_tokens: int, room: int) -> int:
    """Forward passes after the first token: one per further token, up to `max_new_tokens` tokens in all and
    no position past the model's context (`room` positions are left after the prompt)."""
    return max(0, min(max_new_tokens - 1, room))

