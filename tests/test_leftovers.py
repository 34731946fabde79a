"""A request's leftovers (request.py): the new passages its reply leaves to encode run after its Generation is out,
only while no request runs, and stop within a layer for one that arrives.

References: the order of events as the caller sees them (the Generation before any encode); the runner's layers
(a forward stopped after layer 0 wrote no KV of layer 1: its slots keep a sentinel); the passage counters and
where the next request's passages come from (encoded on its path when the leftovers were stopped, from memory
when they ran); the server's admission (a reply gives its place back before its leftovers end: with one place, a
second request is answered while the first one's leftovers are held).
"""

import threading

import pytest
import torch

import pc_rag
from pc_rag.errors import Cancelled
from pc_rag.store import MemoryStore

from .test_passages import DOCS, HEADER, kinds, new_engine, rag


def test_the_generation_comes_before_the_leftovers(loaded):
    engine = new_engine(loaded)
    seen = []
    for item in engine.stream_generation(rag([0, 1, 2], "what is x?"), max_new_tokens=4):
        if isinstance(item, pc_rag.Generation):
            seen.append(engine.stats()["passages"]["encoded_after_reply"])
    seen.append(engine.stats()["passages"]["encoded_after_reply"])
    assert seen == [0, 4]  # the header and three documents, encoded once the caller asked past the Generation
    assert engine.stats()["encodes"]["after_reply"]["forwards"] == 1  # in one batched pass
    closed = new_engine(loaded)
    stream = closed.stream_generation(rag([0, 1, 2], "what is x?"), max_new_tokens=4)
    next(item for item in stream if isinstance(item, pc_rag.Generation))
    stream.close()  # a caller that stops at the Generation leaves no leftovers: encoded at the next sight
    assert closed.stats()["passages"]["encoded_after_reply"] == 0
    assert kinds(closed.generate(rag([2, 0], "and y?"), max_new_tokens=2)) == [("passage", "computed")] * 2


def test_a_cancellable_forward_stops_within_a_layer(engine):
    runner = engine.runner
    ids = list(engine.segmenter.ids(DOCS[0]))[:40]

    class AfterFirstLook:  # a request arrives once the forward has started
        looks = 0

        def is_set(self):
            self.looks += 1
            return self.looks > 1

    cache = runner.new_cache(len(ids))
    cache.keys.fill_(7.0)
    with runner.cancellable(AfterFirstLook()), pytest.raises(Cancelled):
        runner.forward_layers(cache, ids, list(range(len(ids))), list(range(len(ids))))
    assert not torch.all(cache.keys[0] == 7.0)  # layer 0 ran
    assert torch.all(cache.keys[1:] == 7.0)  # no later layer did


def test_leftovers_stop_for_a_request_that_arrives(loaded):
    engine = new_engine(loaded)
    forward_rows = engine.runner.forward_rows

    def arriving(*a, **k):  # another request starts while the leftovers' forward runs
        engine.traffic.running += 1
        try:
            return forward_rows(*a, **k)
        finally:
            engine.traffic.running -= 1

    engine.runner.forward_rows = arriving
    try:
        gen = engine.generate(rag([0, 1], "q1?"), max_new_tokens=2)  # its own forwards run as usual
    finally:
        del engine.runner.forward_rows
    stats = engine.stats()["passages"]
    assert gen.token_ids and stats["encoded_after_reply"] == 0 and stats["stopped_after_reply"] == 1
    # left to the next sight: sent before, so encoded on the next request's path, then reused from memory
    assert kinds(engine.generate(rag([1, 0], "q2?"), max_new_tokens=2)) == [("passage", "computed")] * 2
    assert kinds(engine.generate(rag([3, 0, 1], "q3?"), max_new_tokens=2)) == [("passage", "memory")] * 2


def test_a_reply_gives_its_place_back_before_its_leftovers(loaded):
    pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
    from fastapi.testclient import TestClient

    from pc_rag.serve import ServerSettings, create_app

    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    held, entered = threading.Event(), threading.Event()
    store_missing = engine.assembler.store_missing

    def slow(*a, **k):  # the first request's leftovers, held until the second request is answered
        entered.set()
        held.wait(120)
        return store_missing(*a, **k)

    engine.assembler.store_missing = slow
    body = {"model": "m", "prompt": HEADER + "\n\n".join(DOCS[:3]) + "\n\nQuestion: q?\nAnswer:", "max_tokens": 2,
            "temperature": 0}
    answers = []
    with TestClient(create_app(engine, ServerSettings("m", max_running=1))) as http:
        try:
            first = http.post("/v1/completions", json=body)
            assert first.status_code == 200 and entered.wait(60)
            second = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=body)))
            second.start()
            second.join(60)  # with one place, the second waits for none of the first's leftovers
            assert answers and answers[0].status_code == 200
        finally:
            held.set()
