"""glibc's malloc, set once per process so that a forward's large temporaries are reused, not mapped afresh.

torch allocates every CPU tensor through malloc, and a prefill's activations are MBs each (a large-shape 4K-token
prefill: q|k|v 9 MB, the MLP's gate|up 10-15 MB per block of rows, fused.MLP_BYTES). glibc serves a block over its
mmap threshold from a fresh mapping; it raises that threshold to the size of each mapped block freed (up to 32
MB), and gives the top of its heap back to the OS once more than twice the threshold is free there. So which of a
layer's temporaries come back as fresh pages, each a fault and zeroing, depended on the sizes freed before:
a bf16 cold 4K prefill of the large benchmark shape took 255K page faults with 768-row MLP blocks and 5K with
512-row ones, 9.0-9.3 against 7.0-8.0 s (alternating in one process, 2026-12-03; vLLM's CPU engine took 8.2-8.5 s
alternating with it). With the thresholds fixed below: no faults at either size, and the same 7.4-8.4 s.

`keep_temporaries()` fixes the mmap threshold at glibc's maximum on 64-bit (32 MB; setting it turns the dynamic
one off) and the trim threshold at TRIM_BYTES: blocks up to 32 MB come from the heap and stay there when freed,
as torch's own CUDA allocator keeps its blocks. The cost is memory: up to TRIM_BYTES of freed heap stays mapped.
It runs when a runner on CPU is built, once per process, and not at all where the process was started with its
own malloc settings (the MALLOC_*_ variables or glibc.malloc tunables: those are the user's choice) or where
malloc is not glibc's.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os

log = logging.getLogger("pc_rag")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_BYTES = 256 << 20

_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@functools.cache
def keep_temporaries() -> bool:
    """Set glibc's thresholds as the module docstring says; whether they were set."""
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        log.info("pc_rag: malloc left as the environment set it")
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    log.info("pc_rag: malloc keeps freed blocks up to %d MB (%s)", MMAP_BYTES >> 20, "set" if done else "refused")
    return done


def trim() -> None:
    """Give the heap's free memory back to the OS now (glibc's malloc_trim): once the model's weights are built, the
    checkpoint's tensors they were made from are free, and with TRIM_BYTES kept that stayed resident (0.37B shape in
    bf16: the loaded model added 1.11x its weights' bytes to the process). Nothing where malloc is not glibc's."""
    gc.collect()  # what loading left for the collector (a GGUF reader's parsed fields, say) first
    release()


def release() -> bool:
    """glibc's malloc_trim(0) alone: the free pages of every arena (not only the tops) given back to the OS. A
    server calls it now and then (serve/app.py, TRIM_EVERY_S): a long-running process's arenas otherwise stay
    resident at their high-water marks, which the churn of its bounded caches (store blocks, indexes) raises by
    fragmentation, step by step, for as long as it runs. ctypes drops the GIL for the call. Whether it ran."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
