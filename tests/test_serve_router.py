"""Several `pc-rag serve` workers behind SGLang's router (`sglang-router`, the `router` extra), sharing a Redis
Cluster the test starts (docs/serve.md, "Several machines"). Skipped without sglang_router; without redis-server the
workers keep memory stores only and the shared-store part is skipped.

References: `usage.prompt_tokens_details.cached_tokens` against the prompt's length (turns 2 and 3 of a chat routed
by `cache_aware` reuse at least 80% of their prompt); a chunk another worker encoded counted cached in full; the
workers' own 401 for a wrong key, passed through the router unchanged."""

from __future__ import annotations

import shutil
import threading

import pytest

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("sglang_router", reason="SGLang's router is not installed (pip install -e '.[router]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
httpx = pytest.importorskip("httpx")

from pc_rag.serve.process import RouterProcess, ServerProcess  # noqa: E402
from pc_rag.testing import LocalRedisCluster  # noqa: E402

from .conftest import worktree_env  # noqa: E402
from .test_serve import DOC  # noqa: E402

SYSTEM = "You answer questions about Python from this text. " + DOC + " " + DOC.upper() + " " + DOC[::-1]
QUESTIONS = ["What does the for statement do?", "And the expression list?", "Say it shorter."]
KEYS = "k-alice alice\nk-bob bob\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        yield None
        return
    c = LocalRedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def workers(tiny_path, tmp_path_factory, cluster):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    keys.chmod(0o600)
    stores = ["--store", "memory"] + (["--store", cluster.spec] if cluster else [])
    procs = [ServerProcess(tiny_path, extra=[*stores, "--api-keys", keys],
                           env=worktree_env(tmp_path_factory.mktemp(f"worker{i}"))) for i in range(2)]
    try:
        for p in procs:
            p.launch()  # both load at once
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_cache_aware_routing_keeps_each_chat_on_a_worker_that_reuses_it(workers):
    # As docs/serve.md runs it: health checks on /ready, so a worker with a full line leaves the rotation.
    with RouterProcess([w.url for w in workers], "cache_aware", extra=["--health-check-endpoint", "/ready"],
                       ready_key="k-alice") as router:
        wrong = httpx.post(router.url + "/v1/chat/completions", headers={"Authorization": "Bearer nope"},
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert wrong.status_code == 401  # the router forwards the bearer token; the worker checks it
        shares: dict[int, list[float]] = {}
        errors: list = []

        def chat(user: int) -> None:
            client = openai.OpenAI(base_url=router.url + "/v1", api_key=("k-alice", "k-bob")[user % 2],
                                   max_retries=0, timeout=120)
            messages = [{"role": "system", "content": SYSTEM}]
            try:
                for turn, question in enumerate(QUESTIONS):
                    messages.append({"role": "user", "content": f"User {user}, turn {turn}: {question}"})
                    r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
                    shares.setdefault(user, []).append(
                        r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
                    messages.append({"role": "assistant", "content": r.choices[0].message.content})
            except Exception as e:  # reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=chat, args=(u,)) for u in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors
        assert sorted(shares) == [0, 1, 2, 3]
        for user, turns in shares.items():
            assert len(turns) == 3
            assert min(turns[1:]) >= 0.8, (user, turns)  # the history and the previous reply come back


def test_a_second_worker_reuses_a_chunk_the_first_encoded_through_the_cluster(workers, cluster):
    if cluster is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    doc = DOC.replace("for statement", "while statement") * 2  # a chunk no other test sent
    answers = []
    for worker, question in zip(workers, ("First question?", "Another one?"), strict=True):
        r = httpx.post(worker.url + "/v1/completions", headers={"Authorization": "Bearer k-bob"}, timeout=120,
                       json={"model": "m", "prompt": f"Intro {question}\n{doc}\n{question}", "chunks": [doc],
                             "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        answers.append(r.json()["usage"])
    chunk_tokens = answers[0]["pc_rag"]["cache_creation_tokens"]
    assert chunk_tokens > 0
    # Worker 1 never saw the document: its KV came from the cluster, written by worker 0.
    assert answers[1]["prompt_tokens_details"]["cached_tokens"] >= len(doc) // 8
