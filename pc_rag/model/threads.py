"""Compute threads and OpenMP: a thread that stops computing to wait gives back its OpenMP team.

torch's CPU ops run their parallel loops on OpenMP (libgomp in the Linux wheels). Every thread that runs one
becomes the master of its own team of worker threads, kept until the thread exits. libgomp counts the workers
of all teams, and once they outnumber the cores it stops letting workers spin between parallel regions: each
op then wakes its workers through the kernel. A server has many threads that computed once (request threads
after their prefill, while the decode loop produces their tokens; a thread pool's idle workers; the decode
loop between bursts), so the one thread that is computing paid that wake-up on every op: a lone decode ran at
65-70% of its speed with one idle team alive, and 8 HTTP streams gave 2.3x one stream against 4x in process
(bench model, 2-core machine, docs/speed.md).

`release_team()` frees the calling thread's team (OpenMP 5's `omp_pause_resource_all`, which libgomp
implements as "free this thread's pool"); the next parallel op on that thread builds a new one (measured:
about 0.2 ms for a release and the rebuild, bench machine). Where there is no libgomp (macOS, Windows,
another OpenMP runtime, whose pause is process-wide rather than per thread), it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger("pc_rag")

_OMP_PAUSE_SOFT = 1


@functools.cache
def _pauses() -> tuple:
    """`omp_pause_resource_all` of every libgomp this process loaded (torch's own copy; another library may have
    brought a second one, whose teams are its own), read once from /proc/self/maps: empty where there is none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libgomp" in line})
    except OSError:  # not Linux
        return ()
    found = []
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5 (GCC 9)
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        found.append(fn)
    return tuple(found)


def release_team() -> None:
    """Free the calling thread's OpenMP team; call it where a thread that computed goes on to wait."""
    for pause in _pauses():
        if pause(_OMP_PAUSE_SOFT) != 0:  # nonzero inside a parallel region: nothing freed
            log.debug("pc_rag: omp_pause_resource_all refused on this thread")


def releasing_team(fn):
    """`fn`, freeing the calling thread's OpenMP team when it returns: for the engine's calls that compute and
    return, after which the caller's thread may sit idle (a server's worker, a loop's main thread)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            release_team()

    return call
