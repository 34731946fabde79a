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


class QueueTimeout(Exception):
    """The request waited `timeout_s` without starting: answered 503 with Retry-After."""


class Admission:
    def __init__(self, max_running: int, max_waiting: int):
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"max_running must be >= 1 and max_waiting >= 0, got {max_running}, {max_waiting}")
        self.max_running = max_running
        self.max_waiting = max_waiting
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

    async def acquire(self, timeout_s: float | None) -> None:
        """Take a running place, waiting in line if need be. Raises QueueFull at once when the line is full,
        QueueTimeout after `timeout_s` in line; a cancelled wait (the client went away) leaves the line."""
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
