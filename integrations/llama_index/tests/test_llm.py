"""PromptCacheLLM on the offline tiny Llama: the LlamaIndex LLM surface (random weights: text is noise)."""

import asyncio
import time
from pydoc_data.topics import topics
from typing import Literal

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import TextNode
from llama_index.llms.pc_rag import PromptCacheLLM, __all__, register_nodes
from pydantic import BaseModel, Field

from .recording import RecordingLLM
from .tiny_model import fresh_engine, template_less_model_path, tiny_model_path


def test_all():
    assert sorted(__all__) == sorted(
        ["PromptCacheLLM", "PromptCacheNodeRegistrar", "PromptCacheSynthesizer", "UsageTotals",
         "prompt_cache_query_engine", "register_nodes", "track_usage"]
    )


def test_metadata_loads_nothing():
    llm = PromptCacheLLM(model="/nonexistent/checkpoint", max_new_tokens=7, context_window=2048)
    meta = llm.metadata
    assert (meta.context_window, meta.num_output, meta.is_chat_model) == (2048, 7, True)
    assert llm._loaded is None


def test_context_window_comes_from_the_checkpoint_without_loading_it():
    llm = PromptCacheLLM(model=tiny_model_path())
    assert llm.metadata.context_window == 2048  # the tiny model's max_position_embeddings, not LlamaIndex's 3900
    assert llm._loaded is None
    assert PromptCacheLLM(model=tiny_model_path(), context_window=1000).metadata.context_window == 1000


def test_a_gguf_file_sizes_prompts_from_its_header_and_quantize_loads_a_quantized_engine(tmp_path):
    pytest.importorskip("gguf")
    from pc_rag import Engine, testing

    path = testing.write_gguf(tiny_model_path(), tmp_path / "tiny-q8_0.gguf", "Q8_0")
    llm = PromptCacheLLM(model=str(path), max_new_tokens=6)
    assert llm.metadata.context_window == 2048 and llm._loaded is None  # from the file's header, nothing loaded
    assert llm.get_engine().stats()["model"]["matrices"].get("Q8_0", 0) > 0  # kept quantized as in the file

    quantized = PromptCacheLLM(model=tiny_model_path(), quantize="q8_0", max_new_tokens=6, is_chat_model=False)
    reference = Engine.from_pretrained(tiny_model_path(), quantize="q8_0")
    assert quantized.get_engine().runner.fingerprint == reference.runner.fingerprint
    assert quantized.get_engine().runner.fingerprint != fresh_engine().runner.fingerprint
    prompt = "The quick brown fox jumps over"
    want = PromptCacheLLM(engine=reference, max_new_tokens=6, is_chat_model=False).complete(prompt).text
    assert quantized.complete(prompt).text == want


USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "cached_tokens",
              "cache_creation_tokens"}


def test_complete_stream_and_chat_report_usage():
    llm = PromptCacheLLM(model=tiny_model_path(), max_new_tokens=6)
    done = llm.complete("Hello")
    usage = done.raw["usage"]
    assert set(usage) == USAGE_KEYS and done.text
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["cached_tokens"]}
    assert llm.last_usage == usage

    responses = list(llm.stream_complete("Hello"))
    assert "".join(r.delta for r in responses) == responses[-1].text == done.text  # greedy: same text
    assert responses[-1].raw["usage"]["prompt_tokens"] == usage["prompt_tokens"]

    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    reply = llm.chat(messages)
    assert reply.message.role == "assistant" and reply.raw["usage"]["completion_tokens"] == 6
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="Hi")]))
    assert streamed[-1].raw["usage"]["completion_tokens"] == 6


def test_token_counting_handler_reads_the_engine_counts():
    # LlamaIndex's TokenCountingHandler takes prompt/completion tokens from raw["usage"] when present (else it
    # counts with its own tokenizer, tiktoken): the engine's counts must be what it reports.
    counter = TokenCountingHandler()
    llm = PromptCacheLLM(model=tiny_model_path(), max_new_tokens=5, callback_manager=CallbackManager([counter]))
    usage = llm.complete("The pass statement").raw["usage"]
    assert (counter.prompt_llm_token_count, counter.completion_llm_token_count) == (
        usage["prompt_tokens"], usage["completion_tokens"])


def test_registered_node_text_is_a_cache_hit_in_a_completion():
    llm = PromptCacheLLM(model=tiny_model_path(), max_new_tokens=2)
    node = TextNode(text="The pass statement is a null operation.", metadata={"topic": "pass"})
    register_nodes(llm, [node])
    prompt = f"topic: pass\n\n{node.text}\n\nQ: what is pass?\nA:"
    llm.complete(prompt)
    assert llm.complete(prompt).raw["usage"]["cached_tokens"] > 0


class SlowEngine:
    """The tiny model's engine, sleeping `delay_s` (a blocking sleep, as a forward pass blocks) per piece."""

    def __init__(self, engine, delay_s=0.05):
        self.engine, self.delay_s, self.closed = engine, delay_s, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream_generation(self, prompt, **kwargs):
        try:
            for item in self.engine.stream_generation(prompt, **kwargs):
                time.sleep(self.delay_s)
                yield item
        finally:
            self.closed = True


async def ticks_during(awaitable) -> int:
    """How often a 5 ms ticker ran on the event loop while `awaitable` ran."""
    ticks = 0
    done = False

    async def ticker():
        nonlocal ticks
        while not done:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        await awaitable
    finally:
        done = True
        await task
    return ticks


async def drain(agen):
    return [item async for item in agen]


@pytest.mark.parametrize("method", ["achat", "astream_chat", "acomplete", "astream_complete"])
async def test_async_calls_leave_the_event_loop_running(method):
    # 8 pieces at 50 ms: a call that blocked the loop would let the ticker run 0 times (measured before the
    # fix); off the loop it runs about 80 times. 20 leaves room for a slow, shared CI machine.
    llm = PromptCacheLLM(engine=SlowEngine(fresh_engine()), max_new_tokens=8, context_window=2048)
    messages = [ChatMessage(role="user", content="Hi")]

    async def call():
        if method == "achat":
            return await llm.achat(messages)
        if method == "acomplete":
            return await llm.acomplete("Hi")
        if method == "astream_chat":
            return await drain(await llm.astream_chat(messages))
        return await drain(await llm.astream_complete("Hi"))

    assert await ticks_during(call()) >= 20
    assert llm.last_usage["completion_tokens"] >= 1


async def test_abandoned_async_stream_stops_the_engine():
    engine = SlowEngine(fresh_engine())
    llm = PromptCacheLLM(engine=engine, max_new_tokens=50, context_window=2048)
    stream = await llm.astream_chat([ChatMessage(role="user", content="Hi")])
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):  # the worker stops at its next piece
        if engine.closed:
            break
        await asyncio.sleep(0.02)
    assert engine.closed


def test_chat_model_comes_from_the_tokenizer_once_loaded():
    llm = PromptCacheLLM(model=template_less_model_path(), max_new_tokens=3)
    assert llm._loaded is None
    query_engine = VectorStoreIndex(
        [TextNode(text=topics["pass"][:300])], embed_model=MockEmbedding(embed_dim=8)
    ).as_query_engine(llm=llm)
    query_engine.query("What is pass?")  # was: an error telling to use PromptCacheLLM, the class in use
    assert llm.metadata.is_chat_model is False
    assert llm.last_usage["completion_tokens"] >= 1
    assert PromptCacheLLM(model=tiny_model_path()).metadata.is_chat_model is True  # before loading: the default
    assert PromptCacheLLM(model=template_less_model_path(), is_chat_model=True).metadata.is_chat_model is True


def test_chat_without_a_chat_template_uses_messages_to_prompt():
    llm = PromptCacheLLM(model=template_less_model_path(), max_new_tokens=3)
    reply = llm.chat([ChatMessage(role="user", content="Hi")])
    assert reply.raw["usage"]["completion_tokens"] >= 1


def test_compact_mode_fits_the_model_context():
    # Nodes of ~2,600 tokens in all: more than the tiny model's 2,048, less than LlamaIndex's default 3,900.
    # With 3,900 compact packed them into one prompt the model could not take and answered "Empty Response"
    # (refine swallowed the error); with the model's own context it packs them into several prompts.
    texts = [t[:2000] for k, t in sorted(topics.items()) if len(t) >= 2000][:5]
    index = VectorStoreIndex([TextNode(text=t) for t in texts], embed_model=MockEmbedding(embed_dim=8))
    llm = PromptCacheLLM(model=tiny_model_path(), max_new_tokens=2)
    prompts = []
    llm.__dict__["_record"] = lambda usage: prompts.append(usage["prompt_tokens"])
    index.as_query_engine(llm=llm, similarity_top_k=5).query("What is it?")
    assert len(prompts) >= 2  # every request answered, none refused
    assert sum(prompts) > 2048 and all(n + 2 <= 2048 for n in prompts)


class Answer(BaseModel):
    verdict: Literal["yes", "no"]
    score: int = Field(ge=0, le=9)


async def test_structured_predict_is_a_forced_call_that_validates():
    """LlamaIndex's own structured_predict (a FunctionCallingProgram: one forced call of the output class)."""
    llm = PromptCacheLLM(engine=fresh_engine(), max_new_tokens=100, temperature=1.0)
    prompt = PromptTemplate("Is {x} typed?")
    for seed in range(3):
        got = llm.structured_predict(Answer, prompt, x="Python", llm_kwargs={"seed": seed})
        assert isinstance(got, Answer)
    assert isinstance(await llm.astructured_predict(Answer, prompt, x="Go"), Answer)


def test_tool_calls_in_the_history_are_written_back():
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=2)
    call = ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]})
    result = ChatMessage(role="tool", content="found", additional_kwargs={"tool_call_id": "1"})
    llm.chat([ChatMessage(role="user", content="hi"), call, result])
    text = "".join(s.text for s in llm.records[-1]["segments"])
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>' in text
    assert "<tool_response>\nfound\n</tool_response>" in text


def test_users_with_their_own_cache_salt_share_only_public_nodes():
    """Issue 24: one engine, several users, each with a `cache_salt` (the field or a per-call keyword). Reference: a
    first request of the same prompt on this engine (nothing reused); the same user's second request (reuse
    unchanged within a namespace)."""
    engine = fresh_engine()
    private, public = (TextNode(text=topics[k][:400]) for k in ("pass", "import"))
    register_nodes(PromptCacheLLM(engine=engine), [public], public=True)
    def cached(llm, node, chat=False, **kwargs):
        text = f"Context:\n\n{node.text}\n\nQ: what is it?\nA:"
        if chat:
            return llm.chat([ChatMessage(role="user", content=text)], **kwargs).raw["usage"]["cached_tokens"]
        return llm.complete(text, **kwargs).raw["usage"]["cached_tokens"]

    for chat in (False, True):  # names of their own in each pass (a chat would reuse the completion's BOS)
        alice = PromptCacheLLM(engine=engine, max_new_tokens=2, cache_salt=f"alice{chat}")
        bob = PromptCacheLLM(engine=engine, max_new_tokens=2, cache_salt=f"bob{chat}")
        assert cached(alice, private, chat) == 0
        assert cached(bob, private, chat) == 0  # alice's prompt, sent by bob: nothing reused
        assert cached(alice, private, chat, cache_salt=f"carol{chat}") == 0  # a per-call salt: its own namespace
        assert cached(bob, private, chat, cache_salt=f"alice{chat}") > 0
        assert cached(alice, private, chat) > 0  # alice's own reuse is unchanged
    # a public node is reused by every user (modular mode); the prompt around it is not
    cached(alice, public)
    erin = PromptCacheLLM(engine=engine, max_new_tokens=2, cache_salt="erin")
    assert cached(erin, public) == len(engine.segmenter.ids(public.text.strip()))
