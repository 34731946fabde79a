"""The engine over real store tiers: restarts, other processes, foreign or corrupt entries, Redis outages,
threads. References: a `full` prefill (or a serial run) of the same prompt."""

import json
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text

REPO = Path(__file__).resolve().parents[1]


def rag(docs, order=(0, 1), q="Question: what is described?"):
    parts = [Text("Answer from the documents.\n\n")]
    for i in order:
        parts += [Chunk(docs[i]), Text("\n\n")]
    return parts + [Text(q)]


def chunk_tokens(engine, docs, idx):
    return sum(len(engine.segmenter.ids(docs[i])) for i in idx)


def run_child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CHILD = """
import json, sys, pc_rag
from pc_rag import Chunk, Text
docs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {docs!r}
engine = pc_rag.Engine.from_pretrained({model!r}, store={store!r})
prompt = [Text("Answer from the documents.\\n\\n")]
for i in {order!r}:
    prompt += [Chunk(docs[i]), Text("\\n\\n")]
prompt += [Text({q!r})]
g = engine.generate(prompt, max_new_tokens=8)
print(json.dumps({{"cached": g.cached_tokens, "computed": g.computed_tokens, "ids": list(g.token_ids),
                  "origins": [s.origin for s in g.sources if s.kind == "chunk"]}}))
"""


def test_second_process_reuses_the_disk_cache(tiny_path, docs, tmp_path):
    store = f"disk:{tmp_path}"
    first = run_child(CHILD.format(docs=docs, model=str(tiny_path), store=store, order=[0, 1], q="First?"))
    second = run_child(CHILD.format(docs=docs, model=str(tiny_path), store=store, order=[1, 0], q="Second?"))
    assert first["origins"] == ["computed", "computed"]
    assert second["origins"] == ["disk", "disk"]
    engine = pc_rag.Engine.from_pretrained(tiny_path, store="memory")
    n_chunks = chunk_tokens(engine, docs, (0, 1))
    assert second["cached"] >= n_chunks  # + BOS and system text from the exact-prefix trie
    # only the fresh text was computed: separators and the question
    fresh = sum(len(s) for s in engine.segmenter.segments(rag(docs, (1, 0), "Second?")) if s.kind == "text")
    assert second["computed"] == fresh - len(engine.segmenter.ids("Answer from the documents.\n\n"))
    # and the tokens are what the same request gives in this process from its own memory store
    engine.warm(docs[:2], progress=False)
    engine.generate(rag(docs, (0, 1), "First?"), max_new_tokens=1)
    assert list(engine.generate(rag(docs, (1, 0), "Second?"), max_new_tokens=8).token_ids) == second["ids"]


def test_kv_from_another_model_or_dtype_is_never_used(tmp_path, docs):
    a = pc_rag.testing.build_tiny_llama(tmp_path / "a", seed=0)
    b = pc_rag.testing.build_tiny_llama(tmp_path / "b", seed=1)  # same shape and tokenizer, other weights
    dir_a, dir_b = tmp_path / "cache_a", tmp_path / "cache_b"
    ea = pc_rag.Engine.from_pretrained(a, store=f"disk:{dir_a}")
    ea.generate(rag(docs), max_new_tokens=2)
    shutil.copytree(dir_a, dir_b)  # someone copies model A's cache files into model B's cache directory
    for path, dtype in ((b, "float32"), (a, "bfloat16")):
        eb = pc_rag.Engine.from_pretrained(path, dtype=dtype, store=f"disk:{dir_b}")
        gen = eb.generate(rag(docs), max_new_tokens=8)
        # no chunk comes from A's files; only the repeated "\n\n" separator block B itself just wrote
        assert all(s.origin == "computed" for s in gen.sources if s.kind == "chunk")
        assert gen.cached_tokens <= sum(s.tokens for s in gen.sources if s.kind == "sep")
        ref = pc_rag.Engine.from_pretrained(path, dtype=dtype, store="memory").generate(rag(docs), max_new_tokens=8)
        assert gen.token_ids == ref.token_ids


def test_corrupt_cache_files_are_recomputed(tiny_path, docs, tmp_path):
    engine = pc_rag.Engine.from_pretrained(tiny_path, store=f"disk:{tmp_path}")
    ref = engine.generate(rag(docs), max_new_tokens=8)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    for i, f in enumerate(files):  # truncate some, flip bytes in the others
        data = bytearray(f.read_bytes())
        if i % 2:
            f.write_bytes(data[: len(data) // 2])
        else:
            data[-10:] = bytes(10)
            f.write_bytes(data)
    fresh = pc_rag.Engine.from_pretrained(tiny_path, store=f"disk:{tmp_path}")
    gen = fresh.generate(rag(docs), max_new_tokens=8)
    assert gen.token_ids == ref.token_ids
    assert all(s.origin == "computed" for s in gen.sources if s.kind == "chunk")
    assert gen.cached_tokens <= sum(s.tokens for s in gen.sources if s.kind == "sep")  # re-written this request
    # every chunk file was looked up and found corrupt; the prefix walk stops at its first bad node
    n_chunk_files = sum(f.name.startswith("chunk-") for f in files)
    assert sum(t["corrupt"] for t in fresh.stats()["tiers"]) >= n_chunk_files + 1


def test_threads_get_the_same_outputs_as_serial_runs(engine, docs):
    prompts = [rag(docs, order, f"Question {i}?") for i, order in enumerate([(0, 1), (1, 2), (2, 0), (3, 1)] * 2)]
    serial_engine = pc_rag.Engine(engine.model, engine.tokenizer, store="memory")
    serial = [serial_engine.generate(p, max_new_tokens=6).token_ids for p in prompts]
    results = [None] * len(prompts)

    def work(i):
        results[i] = engine.generate(prompts[i], max_new_tokens=6).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == serial


redis = pytest.importorskip("redis")
REDIS = shutil.which("redis-server")


@pytest.mark.skipif(REDIS is None, reason="redis-server binary not found (apt-get install redis-server)")
def test_two_engine_processes_share_chunks_through_redis_and_survive_an_outage(tiny_path, docs):
    from .test_store_redis import RedisServer

    server = RedisServer()
    server.start()
    try:
        store = server.url
        first = run_child(CHILD.format(docs=docs, model=str(tiny_path), store=store, order=[0, 1], q="A?"))
        second = run_child(CHILD.format(docs=docs, model=str(tiny_path), store=store, order=[1, 0], q="B?"))
        assert first["origins"] == ["computed", "computed"] and second["origins"] == ["redis", "redis"]
        engine = pc_rag.Engine.from_pretrained(tiny_path, store=["memory", store])
        ok = engine.generate(rag(docs, (0, 1), "C?"), max_new_tokens=4)
        assert [s.origin for s in ok.sources if s.kind == "chunk"] == ["redis", "redis"]
        server.stop()  # Redis goes away mid-run: requests still answer, computing what the cache would hold
        engine.store.tiers[0].clear()
        down = engine.generate(rag(docs, (1, 2), "D?"), max_new_tokens=4)
        ref = pc_rag.Engine(engine.model, engine.tokenizer, store="memory")
        ref.warm(docs[:3], progress=False)
        ref.generate(rag(docs, (0, 1), "X?"), max_new_tokens=1)
        assert down.token_ids == ref.generate(rag(docs, (1, 2), "D?"), max_new_tokens=4).token_ids
        server.start()  # and it comes back
        engine.store.retry_now()  # skip the retry back-off in the test
        engine.generate(rag(docs, (3, 0), "E?"), max_new_tokens=2)
        assert redis.Redis.from_url(store).dbsize() > 0
    finally:
        server.stop()


def test_stats_report_tiers(engine, docs):
    engine.generate(rag(docs), max_new_tokens=1)
    tiers = engine.stats()["tiers"]
    assert tiers[0]["name"] == "memory" and tiers[0]["entries"] > 0 and tiers[0]["bytes_held"] > 0
    assert torch.is_tensor(engine.next_token_logits(rag(docs)))
