"""PromptCacheLLM in LlamaIndex's own `FunctionAgent`, with a tool that runs a retriever, on the tiny Llama.

The random-weight model never chooses a tool by itself: the agent's own `initial_tool_choice` forces the first
step's call (constrained to a valid call of that tool); the tool runs, and the next step (tool choice "auto")
answers in text, which ends the run. Everything else is the framework's: the workflow, its memory, the tool call
and tool result messages. The second step's prompt starts with the first step's prompt and reply, and reuses them.
"""

from typing import Annotated

from llama_index.core import VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import TextNode
from llama_index.core.tools import FunctionTool
from pydantic import Field

from .recording import RecordingLLM
from .tiny_model import fresh_engine

TEXTS = ["Decorators wrap a function in another function.", "A generator yields values one at a time."]
RETRIEVER = VectorStoreIndex([TextNode(text=t) for t in TEXTS],
                             embed_model=MockEmbedding(embed_dim=8)).as_retriever(similarity_top_k=2)


def search_docs(query: Annotated[str, Field(max_length=12, description="What to look for.")]) -> str:
    """Search the Python documentation."""
    return "\n\n".join(n.get_content() for n in RETRIEVER.retrieve(query))


async def test_function_agent_calls_the_tool_and_the_next_step_reuses_the_first():
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=100, temperature=1.0, seed=0)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(search_docs)], llm=llm,
                          system_prompt="You answer questions about Python.", initial_tool_choice="search_docs")
    handler = agent.run(user_msg="What do decorators do?")
    calls = []
    async for event in handler.stream_events():
        if type(event).__name__ == "ToolCallResult":
            calls.append(event)
    result = await handler
    assert len(calls) == 1 and calls[0].tool_name == "search_docs"
    assert "Decorators wrap" in calls[0].tool_output.content  # the tool ran with the model's arguments
    assert str(result.response.content)  # the second step answered in text
    first, second = llm.records[:2]
    previous = first["raw"]["usage"]["prompt_tokens"] + first["raw"]["usage"]["completion_tokens"]
    assert first["raw"]["finish_reason"] == "tool_calls"
    assert second["raw"]["usage"]["cached_tokens"] >= 0.9 * previous, (second["raw"]["usage"], previous)
