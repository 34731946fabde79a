"""The standard LangChain integration suite against the offline tiny Llama (random weights: text is noise)."""

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_pc_rag import ChatPromptCache, register_documents
from langchain_tests.integration_tests import ChatModelIntegrationTests
from pydantic import BaseModel, Field

from .tiny_model import fresh_engine, tiny_model_path

DOC = Document(page_content="The assert statement is a convenient way to insert debugging assertions.")


class TestChatPromptCacheIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPromptCache]:
        return ChatPromptCache

    @property
    def chat_model_params(self) -> dict:
        # 100: a forced tool call in the random model's small tokens needs that many to close.
        return {"model": tiny_model_path(), "max_tokens": 100}

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
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # one instance answers with one checkpoint's engine

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {
            "invoke": ["cache_read_input", "cache_creation_input"],
            "stream": ["cache_read_input", "cache_creation_input"],
        }

    # The tests below need a model that understands the request; ours has random weights. Forced calls (tool_choice
    # any/a name) are always valid calls of the right tool (tests/test_tools.py, test_agent.py): what they check
    # beyond that is the content.
    @pytest.mark.xfail(reason="needs a model that understands: asserts the call's args are {'input': 3}")
    def test_tool_calling(self, model) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason="needs a model that understands: asserts the call's args are {'input': 3}")
    async def test_tool_calling_async(self, model) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason="needs a model that understands: json_mode constrains the reply to a JSON object, "
                              "the fields the prompt asks for are the model's to write (ours writes {})")
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(reason="needs a model that understands: tool_choice auto, and the random model never "
                              "chooses to call a tool (create_agent with forced calls: test_agent.py)")
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason="needs a model that understands: the customer's Chinese name must be copied into "
                              "the call, and the random model's free strings run past max_tokens")
    def test_unicode_tool_call_integration(self, model, *, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    # The pydantic variants validate a whole Joke, two free strings (no maxLength): the random model's greedy strings
    # run past max_tokens, and a reply cut there is no Joke. With xgrammar they passed by chance: its greedy path
    # (xgrammar lets the model spell text the grammar forces in any tokens, `set`+`u`+`p`; llguidance only in the
    # tokenizer's own, `set`+`up`) closed the first string and began the second before the cut, which the parser
    # completed. The standard suite allows an override only as a whole-method xfail, so the typeddict and
    # json_schema variants, which check only the keys written and pass, run again below as tests of our own.
    _JOKE = ("needs a model that understands: the pydantic variant needs a whole Joke (two free strings) within "
             "max_tokens (bounded strings: test_structured_output_bounded)")

    @pytest.mark.xfail(reason=_JOKE)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason=_JOKE)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=_JOKE)
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    # A Joke whose punchline is optional: its setup is still a free string, and whether the random model's greedy
    # string closes before max_tokens depends on the prompt's KV (it did before plain prompts were reused as passages).
    @pytest.mark.xfail(reason=_JOKE)
    def test_structured_output_optional_param(self, model) -> None:
        super().test_structured_output_optional_param(model)

    # The standard structured-output test, on a Joke whose two strings have a maxLength: the grammar then closes
    # each string by itself, so a whole Joke fits in max_tokens whatever the random model prefers (without a bound,
    # whether its greedy strings close in time is chance, and it changes with what earlier tests left in the cache).
    # The standard validation only computes a bool; the result is checked here too.
    @pytest.mark.parametrize("schema_type", ["pydantic", "json_schema"])
    def test_structured_output_bounded(self, model, schema_type, monkeypatch) -> None:
        schema = _bounded_joke(monkeypatch, schema_type)
        ChatModelIntegrationTests.test_structured_output(self, model, schema_type)
        _check_joke(model.with_structured_output(schema).invoke("Tell me a joke about cats."), schema)

    @pytest.mark.parametrize("schema_type", ["pydantic", "json_schema"])
    async def test_structured_output_bounded_async(self, model, schema_type, monkeypatch) -> None:
        schema = _bounded_joke(monkeypatch, schema_type)
        await ChatModelIntegrationTests.test_structured_output_async(self, model, schema_type)
        _check_joke(await model.with_structured_output(schema).ainvoke("Tell me a joke about cats."), schema)


    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        # A document no earlier request sent, on an engine with an empty store: encoding it stores its KV.
        llm = ChatPromptCache(engine=fresh_engine(), max_tokens=12)
        doc = Document(page_content=f"{DOC.page_content} It is skipped under -O (stream={stream}).")
        register_documents(llm, [doc])
        messages = [SystemMessage(f"Context:\n\n{doc.page_content}"), HumanMessage("What is assert?")]
        if not stream:
            message = llm.invoke(messages)
        else:
            message = None
            for chunk in llm.stream(messages):
                message = chunk if message is None else message + chunk
        assert message.usage_metadata["input_token_details"]["cache_creation"] > 0
        return message

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatPromptCache(**self.chat_model_params)
        register_documents(llm, [DOC])
        messages = [SystemMessage(f"Context:\n\n{DOC.page_content}"), HumanMessage("What is assert?")]
        llm.invoke(messages)  # the first request encodes the document
        if not stream:
            message = llm.invoke(messages)
        else:
            message = None
            for chunk in llm.stream(messages):
                message = chunk if message is None else message + chunk
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        return message


class BoundedJoke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke", max_length=24)
    punchline: str = Field(description="answer to resolve the joke", max_length=24)


def _bounded_joke(monkeypatch, schema_type: str):
    from langchain_tests.integration_tests import chat_models as standard

    schema = BoundedJoke if schema_type == "pydantic" else BoundedJoke.model_json_schema()
    if schema_type == "pydantic":
        valid = lambda r: isinstance(r, BoundedJoke)  # noqa: E731
    else:
        valid = lambda r: set(r) == {"setup", "punchline"}  # noqa: E731
    monkeypatch.setattr(standard, "_get_joke_class", lambda _: (schema, valid))
    return schema


def _check_joke(result, schema) -> None:
    if schema is BoundedJoke:
        assert isinstance(result, BoundedJoke)
    else:
        assert set(result) == {"setup", "punchline"}
        assert all(isinstance(v, str) and len(v) <= 24 for v in result.values())


def test_quantize_loads_the_checkpoint_quantized_and_answers_as_that_engine():
    from pc_rag import Engine

    chat = ChatPromptCache(model=tiny_model_path(), quantize="q4_0", max_tokens=6)
    reference = Engine.from_pretrained(tiny_model_path(), quantize="q4_0")
    assert chat._engine().stats()["model"]["matrices"].get("Q4_0", 0) > 0
    assert chat._engine().runner.fingerprint == reference.runner.fingerprint
    messages = [HumanMessage("Which fox is quick?")]
    assert chat.invoke(messages).content == ChatPromptCache(engine=reference, max_tokens=6).invoke(messages).content
