"""`pc-rag serve` as users reach it: a real server process on a free port, driven by the `openai` client,
LangChain's ChatOpenAI, LlamaIndex's OpenAILike and plain httpx.

References: the text of every greedy (or seeded) reply against the engine's own output for the same prompt
(an Engine over the same checkpoint in this process, fresh store, same chat template path), exactly;
`cached_tokens` against what reuse must give (a repeated prompt: all but the recomputed last token; a marked
chunk under another prefix: at least the chunk's tokens); status codes and OpenAI's error shape for bad
requests; the server's own /health counts and resident memory for the disconnect run.
"""

from __future__ import annotations

import json
import platform
import random
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
httpx = pytest.importorskip("httpx")

import pc_rag  # noqa: E402
from pc_rag.adapters import chat_prompt, completion_prompt  # noqa: E402
from pc_rag.serve.process import ServerProcess  # noqa: E402
from pc_rag.store import MemoryStore  # noqa: E402
from pc_rag.testing import build_tiny  # noqa: E402

from .conftest import worktree_env  # noqa: E402

DOC = ("The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
       "or other iterable object. The expression list is evaluated once; it should yield an iterable object.")


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    env = worktree_env(tmp_path_factory.mktemp("serve_cache"))
    with ServerProcess(tiny_path, extra=["--store", "memory"], env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def reference(loaded):
    """The engine's own output for a request: same checkpoint, fresh store, greedy unless told."""
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())

    def chat(messages, chunks=(), **kwargs):
        return engine.generate(chat_prompt(engine, messages, chunk_texts=list(chunks)), **kwargs)

    def complete(text, chunks=(), **kwargs):
        return engine.generate(completion_prompt(engine, text, chunk_texts=list(chunks)), **kwargs)

    engine.chat, engine.complete = chat, complete
    return engine


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"{DOC}\n\nQuestion: {question}"}]


# ---- the openai client -----------------------------------------------------------------------------------------
def test_models_and_health(server, client, tiny_path):
    assert [m.id for m in client.models.list().data] == [tiny_path.name]
    assert client.models.retrieve(tiny_path.name).id == tiny_path.name
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-4o")
    health = server.health()
    assert health["status"] == "ok" and health["model"] == tiny_path.name
    assert set(health["decode"]) >= {"steps", "tokens", "max_batch_seen", "active"}
    # run while the model loaded, before any request (a first modular request would pay it in its prefill)
    assert health["relocation_check"]["ok"] and health["relocation_check"]["ms"] > 0


def test_chat_streaming_and_not_equal_the_engine_and_reuse_is_reported(client, reference):
    messages = _messages("what does the statement iterate over?")
    ref = reference.chat(messages, max_new_tokens=12)
    got = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == ref.prompt_tokens and got.usage.completion_tokens == len(ref.token_ids)
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # nothing in the server's store yet
    assert got.model_extra["usage"] if False else got.usage.model_extra["pc_rag"]["mode"] == "modular"

    pieces, usage = [], None
    for event in client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if event.choices and event.choices[0].delta.content:
            pieces.append(event.choices[0].delta.content)
        if event.usage is not None:
            usage = event.usage
    assert "".join(pieces) == ref.text
    # The same prompt again: everything but its last token (recomputed for the logits) is reused.
    assert usage.prompt_tokens_details.cached_tokens == ref.prompt_tokens - 1
    assert usage.model_extra["pc_rag"]["cached_tokens"] == ref.prompt_tokens - 1


def test_completions_streaming_and_not_with_stop_and_seed_equal_the_engine(client, reference):
    text = "Question: what is a generator expression?\nAnswer:"
    ref = reference.complete(text, max_new_tokens=16)
    got = client.completions.create(model="m", prompt=text, max_tokens=16, temperature=0)
    assert got.choices[0].text == ref.text and got.object == "text_completion"
    streamed = "".join(e.choices[0].text for e in client.completions.create(
        model="m", prompt=[text], max_tokens=16, temperature=0, stream=True) if e.choices)
    assert streamed == ref.text
    # A stop string taken from the greedy reply ends it there, streamed or not.
    stop = ref.text[len(ref.text) // 2:][:3]
    ref_stop = reference.complete(text, max_new_tokens=16, stop=[stop])
    got_stop = client.completions.create(model="m", prompt=text, max_tokens=16, temperature=0, stop=stop)
    assert got_stop.choices[0].text == ref_stop.text and got_stop.choices[0].finish_reason == "stop"
    # Seeded sampling: the request's own generator, so the same seed gives the engine's tokens.
    ref_seed = reference.complete(text, max_new_tokens=16, temperature=0.9, top_p=0.8, seed=7)
    got_seed = client.completions.create(model="m", prompt=text, max_tokens=16, temperature=0.9, top_p=0.8, seed=7)
    assert got_seed.choices[0].text == ref_seed.text


def test_cache_control_parts_and_the_chunks_field_mark_chunks(client, reference):
    def ask(system, question, mode="modular"):
        content = [{"type": "text", "text": DOC, "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": f"\n\nQuestion: {question}"}]
        return client.chat.completions.create(
            model="m", max_tokens=4, temperature=0, extra_body={"mode": mode},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": content}])

    doc_tokens = len(reference.segmenter.ids(DOC))
    ask("You are terse.", "first?")
    # Another system text before the same document: no common prefix beyond the template's first tokens, yet
    # the document's KV is reused (relocated) because the part was marked as a chunk.
    second = ask("You answer at length, citing the text.", "second?")
    assert second.usage.prompt_tokens_details.cached_tokens >= doc_tokens - 2
    assert second.usage.model_extra["pc_rag"]["mode"] == "modular"
    full = ask("You answer at length, citing the text.", "second?", mode="full")
    assert full.usage.prompt_tokens_details.cached_tokens == 0 and full.usage.model_extra["pc_rag"]["mode"] == "full"
    # Completions: the `chunks` extension field does the same for a prompt string.
    client.completions.create(model="m", prompt=f"Notes.\n{DOC}\nQ: a?", max_tokens=2, extra_body={"chunks": [DOC]})
    again = client.completions.create(model="m", prompt=f"Other notes here.\n{DOC}\nQ: b?", max_tokens=2,
                                      extra_body={"chunks": [DOC]})
    assert again.usage.prompt_tokens_details.cached_tokens >= doc_tokens - 2


def test_documents_joined_by_the_client_are_reused_in_another_order(server, client, reference):
    # A client that writes its own system message (no cache_control, no chunks field): the documents it sent
    # before are reused wherever they land. Reference: the in-process engine given the same requests in the same
    # order (same passages remembered), exactly; and the documents' own token counts for what must be read.
    from pydoc_data.topics import topics

    docs = [" ".join(topics[k].split())[:400] for k in ("assert", "break", "continue", "pass")]

    def messages(order, question):
        return [{"role": "system", "content": "Answer from these documents.\n\n" + "\n\n".join(docs[i] for i in order)},
                {"role": "user", "content": question}]

    for order, question in (([0, 1, 2], "What is assert?"), ([3, 2, 0], "What is pass?")):
        ref = reference.chat(messages(order, question), max_new_tokens=6, cache_salt="plain-docs")
        encoded = server.health()["encodes"]["after_reply"]["forwards"]
        got = client.chat.completions.create(model="m", messages=messages(order, question), max_tokens=6,
                                             temperature=0, extra_body={"cache_salt": "plain-docs"})
        # The collected reference returns after its leftovers (its new passages stored); the server's run after the
        # reply and give way to a request that arrives (request.py): this client waits for them, as one that sends
        # its next request a moment later finds them done.
        deadline = time.monotonic() + 30
        while server.health()["encodes"]["after_reply"]["forwards"] == encoded and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got.choices[0].message.content == ref.text
        assert got.usage.prompt_tokens_details.cached_tokens == ref.cached_tokens
    reused = sum(len(reference.segmenter.ids(docs[i])) for i in (2, 0))
    assert got.usage.prompt_tokens_details.cached_tokens >= reused
    # Completions: a prompt string the client joined.
    text = "Notes:\n\n" + "\n---\n".join(docs[i] for i in (1, 3)) + "\n\nQ: which?\nA:"
    client.completions.create(model="m", prompt=text, max_tokens=2, extra_body={"cache_salt": "plain-docs"})
    text = "Other notes:\n\n" + "\n---\n".join(docs[i] for i in (3, 1)) + "\n\nQ: which?\nA:"
    again = client.completions.create(model="m", prompt=text, max_tokens=2, extra_body={"cache_salt": "plain-docs"})
    assert again.usage.prompt_tokens_details.cached_tokens >= sum(len(reference.segmenter.ids(docs[i])) for i in (1, 3))


@pytest.mark.parametrize("body, expect", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": 5}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "function with a name"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "needs tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "legacy function calling"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "mode": "sideways"}, "unknown mode"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, "stop"),
])
def test_bad_chat_requests_are_400_in_openai_shape(server, body, expect):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert expect in error["message"] and error["type"] == "invalid_request_error"


def test_unusable_prompts_and_bodies_are_400_even_when_streaming(server, client):
    long_prompt = "word " * 5000  # beyond the tiny model's 2048 positions
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="beyond the model's context"):
            client.completions.create(model="m", prompt=long_prompt, max_tokens=4, stream=stream)
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"]}, timeout=30)
    assert r.status_code == 400 and "one prompt string" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_concurrent_streams_share_decode_steps_and_equal_the_engine(server, client, reference):
    questions = [f"what is item {i}?" for i in range(8)]
    expected = [reference.chat(_messages(q), max_new_tokens=24).text for q in questions]
    before = server.health()["decode"]["tokens"]
    got: list[str | None] = [None] * 8

    def one(i):
        got[i] = "".join(e.choices[0].delta.content or "" for e in client.chat.completions.create(
            model="m", messages=_messages(questions[i]), max_tokens=24, temperature=0, stream=True) if e.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected
    _settle(server)  # places are given back once each request's worker is done, just after its answer
    health = server.health()
    assert health["decode"]["max_batch_seen"] >= 2  # the streams were decoded together
    assert health["decode"]["tokens"] > before


# ---- the framework clients users already have ------------------------------------------------------------------
def test_langchain_chat_openai(server, reference, tiny_path):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage

    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=tiny_path.name, temperature=0,
                        max_tokens=10, stream_usage=True, max_retries=0)
    question = "which objects can it iterate?"
    messages = [SystemMessage("Answer from the document."), HumanMessage(f"{DOC}\n\nQuestion: {question}")]
    ref = reference.chat(_messages(question), max_new_tokens=10)
    first = llm.invoke(messages)
    assert first.content == ref.text
    assert first.usage_metadata["input_tokens"] == ref.prompt_tokens
    streamed = None
    for chunk in llm.stream(messages):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == ref.text
    # ChatOpenAI reads prompt_tokens_details: the repeated prompt's reuse is cache_read.
    assert streamed.usage_metadata["input_token_details"]["cache_read"] == ref.prompt_tokens - 1
    batch = llm.batch([[SystemMessage("Answer from the document."), HumanMessage(f"{DOC}\n\nQuestion: {q}")]
                       for q in ("one?", "two?", "three?")])
    assert [m.content for m in batch] == [reference.chat(_messages(q), max_new_tokens=10).text
                                          for q in ("one?", "two?", "three?")]


def test_llama_index_openai_like(server, reference, tiny_path):
    pytest.importorskip("llama_index.llms.openai_like")
    import asyncio

    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    common = dict(api_base=server.url + "/v1", api_key="unused", model=tiny_path.name, max_tokens=10,
                  temperature=0, context_window=2048, max_retries=0)
    prompt = "Question: what does the with statement do?\nAnswer:"
    ref = reference.complete(prompt, max_new_tokens=10)
    completer = OpenAILike(is_chat_model=False, **common)
    assert completer.complete(prompt).text == ref.text
    assert "".join(r.delta for r in completer.stream_complete(prompt)) == ref.text
    chatter = OpenAILike(is_chat_model=True, **common)
    messages = [ChatMessage(role="system", content="Answer from the document."),
                ChatMessage(role="user", content=f"{DOC}\n\nQuestion: why?")]
    ref_chat = reference.chat(_messages("why?"), max_new_tokens=10)
    assert chatter.chat(messages).message.content == ref_chat.text

    async def concurrently():
        return await asyncio.gather(*[chatter.achat(messages) for _ in range(3)], completer.acomplete(prompt))

    *chats, completion = asyncio.run(concurrently())
    assert [c.message.content for c in chats] == [ref_chat.text] * 3 and completion.text == ref.text
    usage = chats[0].raw.usage
    assert usage.prompt_tokens_details.cached_tokens >= ref_chat.prompt_tokens - 1  # asked before: reused


# ---- auth, the bounded line ------------------------------------------------------------------------------------
def test_api_key_and_a_full_line_answer_401_429_503_and_ready_follows_the_line(tmp_path):
    extra = ["--store", "memory", "--api-key", "s3cret", "--max-running", "1", "--max-waiting", "1",
             "--queue-timeout", "0.8"]
    # The tiny model with room for 16K positions: 1,900 tokens (the most its 2K allow) took about 2 s until the
    # decode step ran as one native call, then under 1.5 s, and finished before the line was looked at.
    model = build_tiny(tmp_path / "long", "llama", max_position_embeddings=16384)
    with ServerProcess(model, extra=extra, env=worktree_env(tmp_path)) as srv:
        assert srv.health() == {"status": "ok"}  # /health needs no key (load balancers), and then tells no more
        assert httpx.get(srv.url + "/ready", timeout=5).json() == {"status": "ready"}  # readiness: no key either
        anonymous = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            anonymous.models.list()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        keyed = {"authorization": "Bearer s3cret"}
        # One long request takes the only place (16,000 tokens: seconds on the tiny model) ...
        with httpx.stream("POST", srv.url + "/v1/completions", headers=keyed, timeout=60,
                          json={"prompt": "Tell me a long story.", "max_tokens": 16000, "temperature": 0,
                                "stream": True}) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response (a disconnect)
            next(lines)
            waited: dict = {}

            def wait_in_line():
                waited["r"] = httpx.post(srv.url + "/v1/completions", headers=keyed, timeout=30,
                                         json={"prompt": "hi", "max_tokens": 2})

            t = threading.Thread(target=wait_in_line)
            t.start()
            time.sleep(0.2)
            # ... one waits for it: the line (1) is full. Readiness says so before a request is sent (a router or
            # load balancer takes this server out while it stays alive) ...
            busy = httpx.get(srv.url + "/ready", timeout=5)
            assert busy.status_code == 503 and busy.json() == {"status": "busy"}
            assert int(busy.headers["retry-after"]) >= 1
            assert srv.health() == {"status": "ok"}  # while still alive
            # ... and the next request is refused at once ...
            full = httpx.post(srv.url + "/v1/completions", headers=keyed, json={"prompt": "hi"}, timeout=30)
            assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["code"] == "queue_full"
            t.join(30)
            # ... and the one in line gives up after --queue-timeout.
            assert waited["r"].status_code == 503 and int(waited["r"].headers["retry-after"]) >= 1
            # A client that hangs up while in line leaves it: nothing of its request runs later.
            with pytest.raises(httpx.TimeoutException):
                httpx.post(srv.url + "/v1/completions", headers=keyed, json={"prompt": "gone"}, timeout=0.2)
            time.sleep(0.3)
            assert srv.health("s3cret")["waiting"] == 0 and srv.health("s3cret")["running"] == 1
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(srv.url + "/ready", timeout=5).status_code == 200  # a place in line again
        _settle(srv, "s3cret")  # a place is given back once the request's worker is done, just after its answer
        health = srv.health("s3cret")
        assert health["rejected"] == 2 and health["served"] == 2  # the long one and this one: not the one that left


# ---- disconnects: nothing leaks --------------------------------------------------------------------------------
def test_a_thousand_requests_with_random_disconnects(server):
    """Reference: no 5xx, every place and decode row given back (/health), and the server's resident memory
    after 2,000 requests within 16 MiB of what it was after the first 1,000 (the warm-up: pooled buffers, the
    allocator's arenas, the prefix blocks and replies of these 8 prompts at these lengths, which the store and
    the reply index keep: a fixed set, so what they hold stops growing). Measured in 200-request steps on a
    2-core AMD EPYC (2026-12-06, stop 51), four runs, base code included: +10 to +22 MiB from request 200 to 1,000
    in jumps (arenas; a 12 MiB bound over that window failed there), then +1.9 to +9.0 MiB from 1,000 to 2,000.
    Earlier machines grew +1 to +7.3 MiB from 200 to 1,000. A leaked 64 KiB buffer per request would add ~62 MiB
    over the window; before the request buffer's reference cycle was broken (model._SlotLayer) freed buffers
    waited for Python's rare full collections."""
    rng = random.Random(0)
    prompts = [f"Question {i}: what does section {i} of the reference manual say?" for i in range(8)]
    statuses: list[int] = []
    lock = threading.Lock()
    rss: dict[int, int] = {}

    def one(i: int, http: httpx.Client):
        body = {"model": "m", "prompt": prompts[i % 8], "max_tokens": rng.choice([8, 16, 32]), "temperature": 0,
                "stream": rng.random() < 0.8}
        cut = rng.choice([0, 1, 2, 5, None, None])  # chunks read before hanging up (None: read it all)
        if body["stream"]:
            with http.stream("POST", "/v1/completions", json=body) as r:
                status = r.status_code
                for n, _line in enumerate(r.iter_lines()):
                    if cut is not None and n >= cut:
                        break  # leaving the block closes the connection mid-stream
        else:
            try:
                status = http.post("/v1/completions", json=body, timeout=0.02 if cut == 0 else 60).status_code
            except httpx.TimeoutException:
                status = 0  # gave up before the answer: the server sees a disconnect
        with lock:
            statuses.append(status)

    def worker(ids):
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for i in ids:
                one(i, http)
                if i == 199:
                    time.sleep(0.5)

    def run(ids):
        threads = [threading.Thread(target=worker, args=(ids[k::8],)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)

    run(list(range(1000)))
    _settle(server)
    rss[1000] = server.rss_bytes()
    run(list(range(1000, 2000)))
    _settle(server)
    rss[2000] = server.rss_bytes()
    assert len(statuses) == 2000
    assert all(s in (0, 200) for s in statuses), sorted(set(statuses))
    health = server.health()
    assert health["running"] == 0 and health["waiting"] == 0
    assert health["decode"]["active"] == 0 and health["decode"]["waiting"] == 0
    growth = rss[2000] - rss[1000]
    print(json.dumps({"rss_after_1000_mib": rss[1000] / 2**20, "rss_after_2000_mib": rss[2000] / 2**20}))
    assert growth < 16 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB from request 1000 to 2000"


def _settle(server, key: str | None = None, timeout_s: float = 30.0) -> None:
    """Wait until the server has no request running (disconnected ones finish their current token first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = server.health(key)
        if h["running"] == 0 and h["decode"]["active"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still running: {server.health(key)}")


# ---- several servers, one Redis ------------------------------------------------------------------------------
def test_passages_from_first_sight_reuse_a_plain_document_in_its_first_prompt(tiny_path, tmp_path):
    """`pc-rag serve --passages-from-first-sight`: on a fresh server, a document sent as plain text is encoded on
    its own and reused in its very first prompt (/metrics: its tokens under kind "passage", computed by the
    request), and found in memory by the next prompt that carries it elsewhere. By default a first prompt is
    computed in place (tests/test_passages.py::test_nothing_changes_before_a_passage_repeats)."""
    import httpx

    doc_tokens = len(pc_rag.Engine.from_pretrained(tiny_path, store="memory").segmenter.ids(DOC))
    with ServerProcess(tiny_path, extra=["--store", "memory", "--passages-from-first-sight"],
                       env=worktree_env(tmp_path)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(text):
            return client.chat.completions.create(model="m", max_tokens=4, temperature=0,
                                                  messages=[{"role": "user", "content": text}])

        def passage_tokens(tier):
            line = f'pc_rag:prompt_tokens_by_source_total{{kind="passage",source="chunk",tier="{tier}"}} '
            found = [x for x in httpx.get(s.url + "/metrics").text.splitlines() if x.startswith(line)]
            return float(found[0].split()[-1]) if found else 0.0

        first = ask(f"Answer from the document below.\n\n{DOC}\n\nQuestion: what is it for?")
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # encoded by this request, not found
        assert passage_tokens("computed") >= doc_tokens - 2 and passage_tokens("memory") == 0
        later = ask(f"Be brief.\n\n{DOC}\n\nQuestion: and how?")
        assert later.usage.prompt_tokens_details.cached_tokens >= doc_tokens - 2
        assert passage_tokens("memory") >= doc_tokens - 2


def test_two_servers_share_one_redis(tiny_path, tmp_path):
    pytest.importorskip("redis")
    from .test_store_redis import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    redis = RedisServer()
    redis.start()
    servers = [ServerProcess(tiny_path, extra=["--store", "memory", "--store", redis.url],
                             env=worktree_env(tmp_path / name)) for name in ("a", "b")]
    try:
        for s in servers:
            s.launch()  # both load at once
        for s in servers:
            s.wait_ready()
        a, b = (openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0) for s in servers)

        def ask(client, system, question):
            content = [{"type": "text", "text": DOC, "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": f"\n\nQuestion: {question}"}]
            return client.chat.completions.create(
                model="m", max_tokens=8, temperature=0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": content}])

        first = ask(a, "You are terse.", "what?")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # Server B never saw the document: its KV comes from Redis, written by A.
        other = ask(b, "You answer at length.", "why?")
        doc_tokens = len(pc_rag.Engine.from_pretrained(tiny_path, store="memory").segmenter.ids(DOC))
        assert other.usage.prompt_tokens_details.cached_tokens >= doc_tokens - 2
        # The very request A answered: B reuses A's prefix blocks (whole 32-token blocks reach Redis) and,
        # greedy, answers the same text.
        same = ask(b, "You are terse.", "what?")
        assert same.choices[0].message.content == first.choices[0].message.content
        assert same.usage.prompt_tokens_details.cached_tokens >= 32
    finally:
        for s in servers:
            s.stop()
        redis.stop()


def test_cli_refuses_bad_serve_options_before_loading_a_model(capsys):
    from pc_rag.cli import main

    assert main(["serve", "--max-running", "0"]) == 2
    assert "--max-running must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--api-key", " "]) == 2
    assert "--api-key is empty" in capsys.readouterr().err


def test_a_first_token_limit_answers_429_naming_it_and_counts_every_request_out(loaded):
    """--ttft-limit in-process: with a limit no prefill can meet, the first request (nothing measured yet) is
    served, the next refused with a 429 naming the limit; every served or refused request leaves the count of
    those without a first token at 0 (a leak would refuse every later request)."""
    from fastapi.testclient import TestClient

    from pc_rag.serve import ServerSettings, create_app

    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    app = create_app(engine, ServerSettings("m", ttft_limit_s=1e-9))
    with TestClient(app) as http:
        body = {"prompt": "Tell me about lists.", "max_tokens": 3, "temperature": 0}
        first = http.post("/v1/completions", json={**body, "stream": True})
        assert first.status_code == 200 and "data: [DONE]" in first.text
        admission = app.state.admission
        assert admission.before_first == 0 and admission.expected_first_token_s() > 0
        late = http.post("/v1/completions", json=body)
        assert late.status_code == 429 and int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["code"] == "ttft_limit" and "--ttft-limit" in late.json()["error"]["message"]
        admission.ttft_limit_s = 60.0  # a limit every request meets: served, and counted out again
        for _ in range(3):
            assert http.post("/v1/completions", json=body).status_code == 200
        assert admission.before_first == 0 and admission.rejected == 1


def test_a_model_without_chat_template_answers_chat_with_a_400(loaded, tiny_path):
    """In-process (FastAPI's TestClient over the same app): a base model's tokenizer has no chat template."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from pc_rag.serve import ServerSettings, create_app

    model, _ = loaded
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.chat_template = None
    engine = pc_rag.Engine(model, tok, store=MemoryStore())
    with TestClient(create_app(engine, ServerSettings("base"))) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_the_server_gives_free_heap_back_while_it_runs(loaded, monkeypatch):
    """The lifespan's trimmer calls model.heap.release every TRIM_EVERY_S, in a thread, while requests are served
    (a soak's arenas otherwise stay at their high-water marks: docs/serve.md, "A long run"), and stops with the app."""
    from fastapi.testclient import TestClient

    from pc_rag.model import heap
    from pc_rag.serve import ServerSettings, app, create_app

    calls, threads = [], set()
    real = heap.release

    def counted():
        threads.add(threading.current_thread().name)
        calls.append(real())
        return calls[-1]

    monkeypatch.setattr(app, "TRIM_EVERY_S", 0.01)
    monkeypatch.setattr(heap, "release", counted)
    model, tok = loaded
    server = create_app(pc_rag.Engine(model, tok, store=MemoryStore()), ServerSettings("m"))
    with TestClient(server) as http:
        body = {"prompt": "Tell me about lists.", "max_tokens": 3, "temperature": 0}
        first = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) >= 3 and threading.main_thread().name not in threads
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == first
        released = http.get("/health").json()["heap_releases"]
        assert released["count"] >= 3 and released["max_ms"] >= released["last_ms"] > 0
    after = len(calls)
    time.sleep(0.1)
    assert len(calls) == after  # stopped with the app
    if platform.libc_ver()[0] == "glibc":
        assert all(calls)  # glibc's malloc_trim ran
