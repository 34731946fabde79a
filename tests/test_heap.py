"""A forward's large temporaries come back from the heap, not as fresh pages (pc_rag/model/heap.py).

Counted in a fresh process (the setting is process-wide): the minor page faults of allocating and touching a
layer's worth of temporaries (15, 7, 1, 15, 7 MB, the sizes of a large-shape prefill's MLP blocks) ten times over,
after two warm-up rounds. Without the setting glibc gave ~38K faults for twenty such rounds here (fresh mappings each
time); with it, none."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")

ROUNDS = """
import resource, torch
from pc_rag.model import heap
def faults():
    ts = [torch.ones(mb << 18) for mb in (15, 7, 1, 15, 7)]  # fp32: mb MB each, every page touched
    del ts
{setup}
faults()
faults()  # after a model load the heap settles in two rounds (faults per round: 11,476, then 5,888, then 0)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    faults()
print(int(kept), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def run(setup: str, **env) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    script = ROUNDS.format(setup=textwrap.dedent(setup))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(x) for x in out.stdout.split()]


@glibc
def test_temporaries_are_reused_from_the_heap():
    kept, faults = run("kept = heap.keep_temporaries()")
    pages = 10 * 45 * 256  # 45 MB a round in 4 KB pages
    assert kept == 1
    assert faults < pages // 20, f"{faults} page faults for {pages} pages of temporaries"


@glibc
def test_the_users_own_malloc_settings_are_left_alone():
    kept, _ = run("kept = heap.keep_temporaries()", MALLOC_TRIM_THRESHOLD_="131072")
    assert kept == 0
    kept, _ = run("kept = heap.keep_temporaries()", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")
    assert kept == 0


@glibc
def test_loading_a_model_on_cpu_sets_it(tiny_path):
    kept, faults = run(f"""
        import pc_rag
        pc_rag.Engine.from_pretrained({str(tiny_path)!r}, store="memory")
        # set by the load, not by this line: a call made now would set it itself (functools.cache counts the first)
        kept = heap.keep_temporaries.cache_info().currsize == 1 and heap.keep_temporaries()
    """)
    assert kept == 1, "loading a model on the CPU did not set malloc's thresholds"
    # After a model load glibc's own dynamic threshold has risen too (1,792 faults here with its defaults), so the
    # faults alone do not tell the setting apart; they show temporaries still come back from the heap.
    assert faults < 10 * 45 * 256 // 20, f"{faults} page faults after a model was loaded"
