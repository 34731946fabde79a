"""What `pc-rag serve` exports at GET /metrics, in Prometheus' text format (prometheus_client).

vLLM's names where the meaning is the same (`vllm:...`), so dashboards and alerts written for vLLM read these;
pc_rag's own under `pc_rag:`. docs/serve.md, "Metrics", has the table. Three kinds of series:

    counted per finished request (`finished`): tokens (prompt, generated, cached, computed, stored, by source),
        the time to the first token, between tokens and to the end, the time in line
    counted per answer (`StatusCounter`, ASGI): completion requests by endpoint and HTTP status
    read when scraped (`_Live`): requests running and waiting, the decode loop, each store tier's bytes, entries,
        hits, misses, evictions and errors, the code each operation of the runner runs (`engine.stats()["backends"]`)

No series is labelled by tenant, key or cache namespace: each is the server's total, so a tenant that may read
/metrics (it takes the same keys as /v1) learns how busy the server is and how much it reuses, nothing of whose.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones below 10 ms for the inter-token latency: a CPU
# decode step of a small model takes a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)

# The paths whose answers `StatusCounter` counts, and the endpoint label of each.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

# TierStats fields exported per tier: (field, metric name, kind, help).
TIER_SERIES = (
    ("bytes_held", "pc_rag:store_bytes", "gauge", "Bytes of KV the tier holds"),
    ("entries", "pc_rag:store_entries", "gauge", "Blocks the tier holds"),
    ("hits", "pc_rag:store_hits", "counter", "Blocks the tier served"),
    ("misses", "pc_rag:store_misses", "counter", "Blocks asked of the tier that it did not hold"),
    ("evictions", "pc_rag:store_evictions", "counter", "Blocks the tier dropped (LRU evictions, TTL expiries)"),
    ("errors", "pc_rag:store_errors", "counter", "Failed operations of the tier (each a miss)"),
    ("corrupt", "pc_rag:store_corrupt", "counter", "Corrupt, truncated or foreign entries found and removed"),
)


class ServerMetrics:
    """One server's metrics, in a registry of its own (several apps in one process keep theirs apart)."""

    def __init__(self, engine, admission):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "pc_rag:requests", "Completion requests answered, by endpoint (chat, completions) and HTTP status (499: "
            "the client left before the answer)", ["endpoint", "status"], registry=registry)
        self.finished_requests = Counter(
            "vllm:request_success", "Requests whose reply was finished, by the finish reason of their first choice "
            "(stop, length, tool_calls)", ["finished_reason"], registry=registry)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of the finished requests, cached ones included (usage.prompt_tokens)",
            registry=registry)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated, over every choice (usage.completion_tokens)",
            registry=registry)
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the KV cache: every prompt token",
            registry=registry)
        self.cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens whose KV was reused (usage.prompt_tokens_details.cached_tokens): "
            "exact prefixes as in vLLM, and relocated chunks", registry=registry)
        self.cached_tokens = Counter(
            "pc_rag:cached_tokens", "Prompt tokens whose KV came from the store (usage.pc_rag.cached_tokens)",
            registry=registry)
        self.computed_tokens = Counter(
            "pc_rag:computed_tokens", "Prompt tokens computed by the requests (usage.pc_rag.computed_tokens; blend's "
            "recomputed ones included)", registry=registry)
        self.recomputed_tokens = Counter(
            "pc_rag:blend_recomputed_tokens", "Reused chunk tokens blend recomputed in context "
            "(usage.pc_rag.recomputed_tokens; counted in computed_tokens)", registry=registry)
        self.stored_tokens = Counter(
            "pc_rag:stored_tokens", "Prompt tokens whose KV the requests newly stored (usage.prompt_tokens_details."
            "cache_write_tokens)", registry=registry)
        self.tokens_by_source = Counter(
            "pc_rag:prompt_tokens_by_source", "Prompt tokens by where their KV came from, as planned: kind (what the "
            "piece holds: bos, text, sep, chunk, scaffold, prefix, passage, ...), source (how it is reused: fresh, "
            "prefix, chunk, scaffold, ...) and tier (memory, disk, redis; computed: by the request). Sums to "
            "vllm:prompt_tokens; the prompt's last token, recomputed for its logits, and blend's recomputed share "
            "count under their piece", ["kind", "source", "tier"], registry=registry)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "From the request's arrival (its time in line included) to its first "
            "token", buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token = Histogram(
            "vllm:inter_token_latency_seconds", "Between each generated token and the one before it, per choice",
            buckets=ITL_BUCKETS, registry=registry)
        self.request_time = Histogram(
            "vllm:e2e_request_latency_seconds", "From the request's arrival to its last token",
            buckets=REQUEST_BUCKETS, registry=registry)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time a request waited in line for a running place",
            buckets=REQUEST_BUCKETS, registry=registry)
        self.live = _Live(engine, admission)
        registry.register(self.live)

    def finished(self, generation, finish_reason: str, arrived: float, started: float) -> None:
        """Count a request whose reply is out: its engine `Generation`, the finish reason its client got, when it
        arrived and when it got its running place (time.perf_counter())."""
        g = generation
        self.finished_requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(g.prompt_tokens)
        self.generation_tokens.inc(g.completion_tokens)
        self.cache_queries.inc(g.prompt_tokens)
        self.cache_hits.inc(g.cached_tokens)
        self.cached_tokens.inc(g.cached_tokens)
        self.computed_tokens.inc(g.computed_tokens)
        self.recomputed_tokens.inc(g.recomputed_tokens)
        self.stored_tokens.inc(g.stored_tokens)
        for s in g.sources:  # whatever kinds and sources the planner makes (passages included), by their names
            self.tokens_by_source.labels(s.kind, s.source, s.origin or "computed").inc(s.tokens)
        self.ttft.observe(started - arrived + g.ttft_s)
        for choice in g.choices:
            for gap in choice.inter_token_s:
                self.inter_token.observe(gap)
        self.request_time.observe(time.perf_counter() - arrived)

    def exposition(self, running: int, waiting: int) -> bytes:
        """The text a scrape gets; `running` and `waiting` read on the event loop's thread (admission.py)."""
        self.live.requests = (running, waiting)
        return generate_latest(self.registry)


class _Live:
    """The series read when scraped: the admission line, the decode loop, the store tiers."""

    def __init__(self, engine, admission):
        self.engine = engine
        self.requests = (admission.running, admission.waiting)

    def describe(self):
        return []  # no fixed set of series: tiers come and go with the store

    def collect(self):
        running, waiting = self.requests
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests holding a running place (prefilling or "
                                "decoding)", value=running)
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in line for a running place",
                                value=waiting)
        stats = self.engine.stats()
        decode = stats["decode"]
        yield GaugeMetricFamily("pc_rag:decode_rows", "Requests decoding in the batched step now",
                                value=decode["active"])
        yield CounterMetricFamily("pc_rag:decode_steps", "Batched decode steps run", value=decode["steps"])
        chosen = GaugeMetricFamily("pc_rag:backend", "The code each operation of the runner's forwards runs, chosen "
                                   "once per runner (1 per operation; engine.stats()['backends'] says why)",
                                   labels=["operation", "backend"])
        for operation, choice in stats["backends"].items():
            chosen.add_metric([operation, choice["backend"]], 1)
        yield chosen
        families = {}
        for field, name, kind, text in TIER_SERIES:
            make = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            families[field] = make(name, text + ", by tier", labels=["tier"])
        seen: dict[str, int] = {}
        for tier in stats["tiers"]:
            label = tier["name"]
            seen[label] = seen.get(label, 0) + 1
            if seen[label] > 1:  # two tiers of one kind (two disks): told apart by their order
                label = f"{label}{seen[label]}"
            for field, family in families.items():
                family.add_metric([label], tier.get(field, 0))
        yield from families.values()


class StatusCounter:
    """ASGI middleware counting each answer of the completion endpoints by its status (`ServerMetrics.requests`),
    those of the middleware under it (413, 421) and of auth (401) included; a client gone before any answer was
    started is counted 499."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        endpoint = ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            if not started:
                self.metrics.requests.labels(endpoint, "499").inc()
