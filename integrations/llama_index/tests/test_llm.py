"""PromptCacheLLM on the offline tiny Llama: the LlamaIndex LLM surface (random weights: text is noise)."""

from llama_index.core.llms import ChatMessage
from llama_index.llms.pc_rag import PromptCacheLLM, __all__, register_nodes

from .tiny_model import tiny_model_path


def test_all():
    assert sorted(__all__) == sorted(
        ["PromptCacheLLM", "PromptCacheNodeRegistrar", "PromptCacheSynthesizer", "prompt_cache_query_engine",
         "register_nodes"]
    )


def test_metadata_loads_nothing():
    llm = PromptCacheLLM(model="/nonexistent/checkpoint", max_new_tokens=7, context_window=2048)
    meta = llm.metadata
    assert (meta.context_window, meta.num_output, meta.is_chat_model) == (2048, 7, True)
    assert llm._loaded is None


def test_complete_stream_and_chat_report_usage():
    llm = PromptCacheLLM(model=tiny_model_path(), max_new_tokens=6)
    done = llm.complete("Hello")
    assert set(done.raw["usage"]) >= {"prompt_tokens", "completion_tokens", "cached_tokens", "cache_creation_tokens"}
    assert done.raw["usage"]["completion_tokens"] == 6 and done.text

    responses = list(llm.stream_complete("Hello"))
    assert "".join(r.delta for r in responses) == responses[-1].text == done.text  # greedy: same text
    assert responses[-1].raw["usage"]["prompt_tokens"] == done.raw["usage"]["prompt_tokens"]

    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    reply = llm.chat(messages)
    assert reply.message.role == "assistant" and reply.raw["usage"]["completion_tokens"] == 6
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="Hi")]))
    assert streamed[-1].raw["usage"]["completion_tokens"] == 6


def test_registered_node_text_is_a_cache_hit_in_a_completion():
    from llama_index.core.schema import TextNode

    llm = PromptCacheLLM(model=tiny_model_path(), max_new_tokens=2)
    node = TextNode(text="The pass statement is a null operation.", metadata={"topic": "pass"})
    register_nodes(llm, [node])
    prompt = f"topic: pass\n\n{node.text}\n\nQ: what is pass?\nA:"
    llm.complete(prompt)
    assert llm.complete(prompt).raw["usage"]["cached_tokens"] > 0
