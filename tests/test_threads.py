"""A thread that computed and then waits holds no OpenMP team (pc_rag/model/threads.py).

Counted in a fresh process (no other test's threads): the OS threads alive that are not Python's, from /proc. A
team on a 2-thread setting is one worker thread beside the thread that computed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pc_rag.model.threads import _pauses

pytestmark = pytest.mark.skipif(not _pauses(), reason="no libgomp in this process (not Linux, or another OpenMP)")


COUNT = """
import os, threading, torch
torch.set_num_threads(2)
def alive():  # threads that are not Python's: OpenMP's workers
    return len(os.listdir("/proc/self/task")) - threading.active_count()
"""


def run(script: str) -> list[int]:
    # Without the other native pools that start when first used: OpenBLAS's (numpy, scipy) and tokenizers'.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(x) for x in out.stdout.split()]


def test_release_team_ends_the_calling_threads_openmp_workers():
    before, computed, released, again = run(COUNT + """
from pc_rag.model import release_team
counts = []
def work():
    counts.append(alive())
    x = torch.randn(256, 256)
    torch.nn.functional.softmax(x @ x, dim=-1).sum()
    counts.append(alive())
    release_team()
    counts.append(alive())
    (x @ x).sum()  # the next parallel op builds a team again
    counts.append(alive())
t = threading.Thread(target=work); t.start(); t.join()
print(*counts)
""")
    assert computed > before, "the parallel ops started no OpenMP worker (nothing to measure)"
    assert released == before
    assert again == computed


def test_engine_threads_hold_no_team_once_their_requests_are_done(tiny_path):
    """The server's shape: the model loaded on one thread, requests on a pool's long-lived workers, two at a
    time (the batched decode loop). Once every request is done, only the pool's threads are left: none holds
    workers that would slow the next request's ops (docs/speed.md)."""
    base, after_load, after_requests = run(COUNT + f"""
from concurrent.futures import ThreadPoolExecutor
import pc_rag
from pc_rag.store import MemoryStore
base = alive()
engine = pc_rag.Engine.from_pretrained({str(tiny_path)!r}, store=MemoryStore())
after_load = alive()
pool = ThreadPoolExecutor(max_workers=2)
ask = lambda i: engine.generate(f"Question {{i}}: what is a frame object?", max_new_tokens=12)
list(pool.map(ask, range(4)))
engine.wait_for_background()
# The decode loop gives its team back when it finds nothing to decode, on its own thread, which may be a moment
# after the last reply returned (a clean-clone CI run counted it once before then: 2 against 1).
import time
deadline = time.monotonic() + 5
while alive() != base and time.monotonic() < deadline:
    time.sleep(0.02)
print(base, after_load, alive())
""")
    assert after_load == base
    assert after_requests == base
