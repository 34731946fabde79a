"""The standard LangChain integration suite against the offline tiny Llama (random weights: text is noise)."""

from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_pc_rag import ChatPromptCache, register_documents
from langchain_tests.integration_tests import ChatModelIntegrationTests

from .tiny_model import fresh_engine, tiny_model_path

DOC = Document(page_content="The assert statement is a convenient way to insert debugging assertions.")


class TestChatPromptCacheIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPromptCache]:
        return ChatPromptCache

    @property
    def chat_model_params(self) -> dict:
        return {"model": tiny_model_path(), "max_tokens": 12}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

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
