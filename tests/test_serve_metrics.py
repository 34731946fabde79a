"""GET /metrics (pc_rag/serve/metrics.py), parsed with prometheus_client's own parser.

References: the `usage` of every request made, summed (prompt, completion, cached, computed, stored tokens),
against the counters; the requests made, by endpoint and status; the histograms' counts against the requests and
their tokens; the store tiers' series against `engine.stats()`; no label beyond the documented ones (none names a
tenant); the same keys as /v1."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("prometheus_client", reason="/metrics needs the serve extra (prometheus-client)")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import pc_rag  # noqa: E402
from pc_rag.serve import ServerSettings, create_app  # noqa: E402
from pc_rag.serve.auth import APIKey  # noqa: E402
from pc_rag.store import MemoryStore  # noqa: E402

DOC = "The for statement iterates over the elements of a sequence, such as a string, a tuple or a list."
LABELS = {"endpoint", "status", "finished_reason", "kind", "source", "tier", "operation", "backend", "le"}


def scrape(http, key: str | None = None) -> dict[str, list]:
    r = http.get("/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def total(metrics, name, **labels) -> float:
    return sum(s.value for s in metrics.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def usage_of(response) -> dict:
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        return next(e["usage"] for e in events if e.get("usage"))
    return response.json()["usage"]


def test_counters_equal_the_usage_of_the_requests_made(loaded):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    messages = [{"role": "user", "content": [{"type": "text", "text": DOC, "cache_control": {"type": "ephemeral"}},
                                             {"type": "text", "text": "\nWhat does it iterate over?"}]}]
    with TestClient(create_app(engine, ServerSettings("m"))) as http:
        assert total(scrape(http), "vllm:prompt_tokens_total") == 0
        responses = [
            http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}),
            http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "stream": True,
                                                    "stream_options": {"include_usage": True}}),
            http.post("/v1/completions", json={"prompt": f"Notes: {DOC}\nQ:", "max_tokens": 4, "n": 3,
                                               "temperature": 1.0, "seed": 1}),
            http.post("/v1/completions", json={"prompt": f"Notes: {DOC}\nQ:", "max_tokens": 7, "stream": True,
                                               "stream_options": {"include_usage": True}, "mode": "blend",
                                               "chunks": [DOC]}),
        ]
        bad = http.post("/v1/chat/completions", json={"messages": messages, "top_k": 3})
        assert bad.status_code == 400 and all(r.status_code == 200 for r in responses)
        usages = [usage_of(r) for r in responses]
        m = scrape(http)
    sums = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0  # the second chat reused the first's prompt: the check below compares a count, not zeros
    assert total(m, "vllm:prompt_tokens_total") == sums["prompt_tokens"]
    assert total(m, "vllm:prefix_cache_queries_total") == sums["prompt_tokens"]
    assert total(m, "vllm:generation_tokens_total") == sums["completion_tokens"]
    assert total(m, "vllm:prefix_cache_hits_total") == total(m, "pc_rag:cached_tokens_total") == cached
    assert total(m, "pc_rag:computed_tokens_total") == sum(u["pc_rag"]["computed_tokens"] for u in usages)
    assert total(m, "pc_rag:blend_recomputed_tokens_total") == sum(u["pc_rag"]["recomputed_tokens"] for u in usages)
    assert total(m, "pc_rag:stored_tokens_total") == sum(u["prompt_tokens_details"]["cache_write_tokens"]
                                                         for u in usages)
    # Where the prompt tokens' KV came from: every prompt token once; a reused chunk under "chunk".
    assert total(m, "pc_rag:prompt_tokens_by_source_total") == sums["prompt_tokens"]
    assert total(m, "pc_rag:prompt_tokens_by_source_total", source="chunk", tier="memory") > 0
    assert total(m, "pc_rag:requests_total", endpoint="chat", status="200") == 2
    assert total(m, "pc_rag:requests_total", endpoint="completions", status="200") == 2
    assert total(m, "pc_rag:requests_total", endpoint="chat", status="400") == 1
    assert total(m, "vllm:request_success_total") == 4
    assert total(m, "vllm:time_to_first_token_seconds_count") == 4
    assert total(m, "vllm:e2e_request_latency_seconds_count") == 4
    assert total(m, "vllm:request_queue_time_seconds_count") == 4
    # a gap between each token and the one before it, per choice (n=3 counts three replies)
    choices = [1, 1, 3, 1]
    assert total(m, "vllm:inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - c for u, c in zip(usages, choices, strict=True))
    assert total(m, "vllm:num_requests_running") == 0 and total(m, "vllm:num_requests_waiting") == 0
    tier = engine.stats()["tiers"][0]
    assert total(m, "pc_rag:store_entries", tier="memory") == tier["entries"] > 0
    assert total(m, "pc_rag:store_bytes", tier="memory") == tier["bytes_held"]
    assert total(m, "pc_rag:store_hits_total", tier="memory") == tier["hits"]
    assert total(m, "pc_rag:decode_rows") == 0
    backends = engine.stats()["backends"]
    assert {(s.labels["operation"], s.labels["backend"]) for s in m["pc_rag:backend"]} == {
        (op, choice["backend"]) for op, choice in backends.items()}
    assert {k for samples in m.values() for s in samples for k in s.labels} <= LABELS  # no tenant, key or salt


def test_metrics_take_the_same_keys_as_v1(loaded):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    settings = ServerSettings("m", api_keys=(APIKey.of("s3cret", "alpha", "test"),))
    with TestClient(create_app(engine, settings)) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
        m = scrape(http, "s3cret")
    assert total(m, "pc_rag:requests_total", endpoint="completions", status="401") == 1
    assert total(m, "vllm:prompt_tokens_total") == 0
