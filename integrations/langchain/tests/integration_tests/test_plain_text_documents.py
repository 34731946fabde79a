"""LangChain 1.x's RAG tutorial shapes on the tiny Llama, only the model swapped: documents the app joins into the
prompt itself (a `@dynamic_prompt` middleware calling the store's search, a tool returning joined text) are reused
at any position from the second request on, with no retriever object, registration or hook.

Reference: each document's own token count in the prompt (the engine's split of the prompt the adapter built);
the second request, whose documents come in another order, must read at least all of those its first request
carried from the cache (`usage_metadata["input_token_details"]["cache_read"]`), and its answer must equal an
engine given the same prompt as `Chunk` segments (greedy, the registered-chunk path)."""

from pydoc_data.topics import topics

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, dynamic_prompt
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_pc_rag import ChatPromptCache

from .tiny_model import fresh_engine

DOCS = [" ".join(topics[k].split())[:500] for k in ("try", "with", "import", "class", "lambda")]


class FakeVectorStore:
    """`similarity_search` as a vector store answers it: here the documents are chosen by the test, in order."""

    def __init__(self):
        self.order = [0, 1, 2]

    def similarity_search(self, query, k=3):
        return [DOCS[i] for i in self.order[:k]]


STORE = FakeVectorStore()


@dynamic_prompt
def prompt_with_context(request: ModelRequest) -> str:
    # The tutorial's "RAG chain": retrieve for the last message, join the documents into the system message.
    docs = STORE.similarity_search(request.state["messages"][-1].text)
    return "You are a helpful assistant. Use the following context in your response:\n\n" + "\n\n".join(docs)


def ask(agent, question):
    messages = agent.invoke({"messages": [{"role": "user", "content": question}]})["messages"]
    return [m for m in messages if isinstance(m, AIMessage)][-1]


def test_middleware_documents_are_reused_in_another_order():
    engine = fresh_engine()
    llm = ChatPromptCache(engine=engine, max_tokens=8)
    agent = create_agent(llm, tools=[], middleware=[prompt_with_context])
    STORE.order = [0, 1, 2]
    first = ask(agent, "What does try do?")
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    STORE.order = [3, 1, 0]
    second = ask(agent, "And what does with do?")
    reused = sum(len(engine.segmenter.ids(DOCS[i])) for i in (1, 0))
    read = second.usage_metadata["input_token_details"]["cache_read"]
    assert read >= reused, (read, reused)
    assert engine.stats()["passages"]["reused"] == 2
    # The same answer as the registered-chunk path gives for the same prompt.
    reference = fresh_engine()
    reference.register([DOCS[1], DOCS[0]])
    STORE.order = [3, 1, 0]
    again = ask(create_agent(ChatPromptCache(engine=reference, max_tokens=8), tools=[],
                             middleware=[prompt_with_context]), "And what does with do?")
    assert again.content == second.content


@tool
def search_docs(query: str) -> str:
    """Search the Python documentation."""
    return "\n\n".join(STORE.similarity_search(query))


def test_tool_results_joined_by_the_tool_are_reused_in_another_order():
    engine = fresh_engine()
    llm = ChatPromptCache(engine=engine, max_tokens=8)
    results = []
    # The text a reply answers (the prompt's last run of content: here the tool result's last document) is computed
    # in context, never a passage (pc_rag.passages.answered_span); the documents before it are reused.
    for order in ([0, 1, 2], [1, 0, 3]):
        STORE.order = order
        # The tool's text as the agent's loop puts it into the history: a tool call, then its result.
        text = search_docs.invoke("python")
        messages = [{"role": "user", "content": "What is in the docs?"},
                    AIMessage("", tool_calls=[{"name": "search_docs", "args": {"query": "python"}, "id": "c1"}]),
                    ToolMessage(text, tool_call_id="c1")]
        results.append(llm.invoke(messages))
    reused = sum(len(engine.segmenter.ids(DOCS[i])) for i in (1, 0))
    assert results[1].usage_metadata["input_token_details"]["cache_read"] >= reused
