"""How many requests the server runs at once, and how many it lets wait: a bounded queue, first come first served.

Plain asyncio bookkeeping (the event loop's thread only), tested without a model or HTTP. A running request
holds its place from admission until its worker thread has closed the engine's stream (buffer back in the
pool), so a client that disconnects frees its place only once its request has really stopped.
"""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFull(Exception):
    """Every place is taken and `max_waiting` requests already wait: answered 429 with Retry-After."""


class TooLate(QueueFull):
    """With a first-token limit (`ttft_limit_s`): by the recent prefills, this request's first token would come
    after it. Answered 429 with Retry-After, at once, rather than served late."""

    def __init__(self, expected_s: float):
        super().__init__(expected_s)
        self.expected_s = expected_s


class QueueTimeout(Exception):
    """The request waited `timeout_s` without starting: answered 503 with Retry-After."""


class Admission:
    """`ttft_limit_s` (None: off) bounds the wait for a first token by a stated rule: the engine runs prefills one
    at a time in arrival order, so a newcomer's first token comes after the prefills of every request ahead of it
    that has no first token yet (running or in line) and its own. Over the last 32 prefills' service times, a
    request whose `ahead x mean + p90` exceeds the limit is refused (429) at once. A prefill's service time is
    measured as a single queue's: from the later of its start and the previous first token, to its own first
    token (`first_token`). Why these two figures: the wait ahead is a sum of service times (its expectation is
    their mean), while the newcomer's own prefill is one draw from a skewed spread (a prompt whose documents are
    new costs several cached ones), bounded by a high quantile. Counting every prefill at the median undershot
    (TTFT p99 3.35 s under a 2 s limit, modular, 4 req/s, benchmarks.serving), and so did the mean (3.18 s)."""

    def __init__(self, max_running: int, max_waiting: int, ttft_limit_s: float | None = None):
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"max_running must be >= 1 and max_waiting >= 0, got {max_running}, {max_waiting}")
        if ttft_limit_s is not None and not ttft_limit_s > 0:
            raise ValueError(f"ttft_limit_s must be None or > 0, got {ttft_limit_s}")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.ttft_limit_s = ttft_limit_s
        self.before_first = 0  # running requests whose first token is not out yet
        self._prefill_s: deque[float] = deque(maxlen=32)  # service times of the last prefills
        self._last_first = 0.0  # perf_counter() of the last first token
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.rejected = 0  # QueueFull and QueueTimeout answers so far
        self.served = 0
        self._recent_s: deque[float] = deque(maxlen=32)  # durations of the last requests, for Retry-After

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    @property
    def has_room(self) -> bool:
        """Whether a request arriving now would be taken (run or put in line) rather than refused with a 429."""
        return self.running < self.max_running or self.waiting < self.max_waiting

    def expected_first_token_s(self) -> float | None:
        """When a request arriving now would get its first token, by the rule above (None: no prefill measured)."""
        if not self._prefill_s:
            return None
        times = sorted(self._prefill_s)
        mean = sum(times) / len(times)
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
        return (self.before_first + self.waiting) * mean + p90

    def first_token(self, started: float, now: float) -> None:
        """A running request's first token is out (`started`: when it got its place; times by perf_counter)."""
        self.before_first -= 1
        self._prefill_s.append(max(0.0, now - max(started, self._last_first)))
        self._last_first = now

    def no_first_token(self) -> None:
        """A running request failed or left before its first token."""
        self.before_first -= 1

    async def acquire(self, timeout_s: float | None) -> None:
        """Take a running place, waiting in line if need be. Raises QueueFull at once when the line is full,
        TooLate at once when the first token would come after `ttft_limit_s`, QueueTimeout after `timeout_s` in
        line; a cancelled wait (the client went away) leaves the line. The caller reports the first token
        (`first_token`)."""
        if self.ttft_limit_s is not None:
            expected = self.expected_first_token_s()
            if expected is not None and expected > self.ttft_limit_s:
                self.rejected += 1
                raise TooLate(expected)
        await self._take(timeout_s)
        self.before_first += 1

    async def _take(self, timeout_s: float | None) -> None:
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            self.rejected += 1
            raise QueueFull
        place = asyncio.get_running_loop().create_future()
        self._waiters.append(place)
        try:
            await asyncio.wait_for(asyncio.shield(place), timeout_s)
        except TimeoutError:
            if place.done() and not place.cancelled():  # handed a place just as the wait ran out: keep it
                return
            place.cancel()
            self.rejected += 1
            raise QueueTimeout from None
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():
                self.release()  # handed a place, but nobody will use it
            else:
                place.cancel()
            raise
        finally:
            self._drop_done()

    def release(self, duration_s: float | None = None) -> None:
        """Give a running place back: to the first in line, else free it."""
        if duration_s is not None:
            self._recent_s.append(duration_s)
            self.served += 1
        while self._waiters:
            place = self._waiters.popleft()
            if not place.done():
                place.set_result(None)  # the place passes on: `running` does not change
                return
        self.running -= 1

    def retry_after_s(self) -> int:
        """A guess for Retry-After: the time for the line ahead to move through the running places."""
        typical = sorted(self._recent_s)[len(self._recent_s) // 2] if self._recent_s else 1.0
        return max(1, round(typical * (1 + self.waiting / self.max_running)))

    def _drop_done(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
