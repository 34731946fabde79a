"""ChatPromptCache without a model: the standard unit suite, and the request path against an engine double."""

from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate, format_document
from langchain_core.retrievers import BaseRetriever
from langchain_pc_rag import ChatPromptCache, PromptCacheLLM, PromptCacheRetriever, register_documents
from langchain_tests.unit_tests import ChatModelUnitTests

from pc_rag.segments import Chunk, Text

from .fake_engine import FakeEngine

DOCS = [
    Document(page_content="Basel lies on the Rhine.\n", metadata={"source": "a.txt"}),
    Document(page_content="Lyon lies on the Rhone.", metadata={"source": "b.txt"}),
]


class TestChatPromptCacheUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatPromptCache]:
        return ChatPromptCache

    @property
    def chat_model_params(self) -> dict:
        # Never loaded: construction is lazy and the unit suite makes no requests.
        return {"model": "/nonexistent/llama-checkpoint"}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supports_model_override(self) -> bool:
        return False  # one instance answers with one checkpoint's engine


class ListRetriever(BaseRetriever):
    documents: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        return self.documents


def stuff_context(documents):
    # What langchain's create_stuff_documents_chain does with its defaults: "{page_content}" per document,
    # joined with "\n\n", into the prompt's {context} variable.
    return "\n\n".join(format_document(d, PromptTemplate.from_template("{page_content}")) for d in documents)


def test_stuff_chain_prompt_sends_registered_documents_as_chunks():
    engine = FakeEngine()
    llm = ChatPromptCache(engine=engine, max_tokens=8)
    retriever = PromptCacheRetriever(retriever=ListRetriever(documents=DOCS), llm=llm)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{input}")]
    )
    chain = {"context": retriever | stuff_context, "input": lambda q: q} | prompt | llm
    message = chain.invoke("Which river?")

    segments, kwargs = engine.calls[-1]
    # The documents' stripped text are the chunks; the trailing "\n" of the first stays in the text around it.
    assert [s for s in segments if isinstance(s, Chunk)] == [
        Chunk("Basel lies on the Rhine."),
        Chunk("Lyon lies on the Rhone."),
    ]
    assert Text("\n\n\n") in segments
    assert "".join(s.text for s in segments) == (
        "<system>Answer from the context.\n\nBasel lies on the Rhine.\n\n\nLyon lies on the Rhone.</system>"
        "<user>Which river?</user><assistant>"
    )
    assert kwargs["max_new_tokens"] == 8 and kwargs["temperature"] == 0.0 and kwargs["mode"] == "modular"
    assert message.content == "Hello there"
    assert message.usage_metadata["input_token_details"] == {"cache_read": 47, "cache_creation": 0}
    assert message.response_metadata["finish_reason"] == "length"


def test_stream_ends_with_one_usage_chunk_and_call_options_override_fields():
    engine = FakeEngine()
    llm = ChatPromptCache(engine=engine, temperature=0.5, stop=["x"])
    chunks = list(llm.stream([SystemMessage("s"), HumanMessage("hi")], stop=["y"], max_tokens=3))
    assert [c.content for c in chunks] == ["Hello", " there", ""]
    assert [c.usage_metadata is not None for c in chunks] == [False, False, True]
    assert chunks[-1].chunk_position == "last"
    _, kwargs = engine.calls[-1]
    assert kwargs["stop"] == ["y"] and kwargs["max_new_tokens"] == 3 and kwargs["temperature"] == 0.5


def test_unregistered_prompt_is_all_text():
    engine = FakeEngine()
    ChatPromptCache(engine=engine).invoke("Bern lies on the Aare (no retriever ever returned this).")
    segments, _ = engine.calls[-1]
    assert all(isinstance(s, Text) for s in segments)


def test_image_content_is_refused_with_a_message():
    llm = ChatPromptCache(engine=FakeEngine())
    message = HumanMessage(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    try:
        llm.invoke([message])
    except ValueError as e:
        assert "text only" in str(e)
    else:
        raise AssertionError("image content was accepted")


def test_completion_llm_splits_the_raw_prompt_and_reports_usage():
    engine = FakeEngine()
    llm = PromptCacheLLM(engine=engine)
    retriever = PromptCacheRetriever(retriever=ListRetriever(documents=DOCS), llm=llm)
    retriever.invoke("q")
    result = llm.generate([f"Context: {DOCS[1].page_content}\nQ: river?\nA:"])
    segments, _ = engine.calls[-1]
    assert segments == [Text("Context: "), Chunk("Lyon lies on the Rhone."), Text("\nQ: river?\nA:")]
    generation = result.generations[0][0]
    assert generation.text == "Hello there"
    assert generation.generation_info["usage"]["cached_tokens"] == len("Lyon lies on the Rhone.")


def test_completion_llm_reports_summed_token_usage_in_llm_output():
    # What OpenAI-style consumers read (langchain-community's OpenAI callback: llm_output["token_usage"]).
    engine = FakeEngine()
    llm = PromptCacheLLM(engine=engine, model="m")
    register_documents(llm, [DOCS[1]])
    prompts = [f"Context: {DOCS[1].page_content}\nQ: river?\nA:", "Q: hi\nA:"]
    result = llm.generate(prompts)
    totals = [len(p) for p in prompts]  # the engine double counts characters
    assert result.llm_output == {
        "token_usage": {
            "prompt_tokens": sum(totals),
            "completion_tokens": 4,
            "total_tokens": sum(totals) + 4,
            "prompt_tokens_details": {"cached_tokens": len(DOCS[1].page_content)},
            "cache_creation_tokens": 0,
        },
        "model_name": "m",
    }


def test_missing_model_and_engine_is_a_clear_error():
    try:
        ChatPromptCache().invoke("hi")
    except ValueError as e:
        assert "model=" in str(e)
    else:
        raise AssertionError("no error")
