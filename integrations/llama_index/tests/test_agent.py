"""PromptCacheLLM in LlamaIndex's own `FunctionAgent`, with a tool that runs a retriever, on the tiny Llama.

The random-weight model never chooses a tool by itself: the agent's own `initial_tool_choice` forces the first
step's call (constrained to a valid call of that tool); the tool runs, and the next step (tool choice "auto")
answers in text, which ends the run. Everything else is the framework's: the workflow, its memory, the tool call
and tool result messages. The second step's prompt starts with the first step's prompt and reply, and reuses them.
"""

from typing import Annotated, Literal

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


# A topic from a list: FunctionTool's schema keeps an enum but drops a string's max_length, and the random model's
# free string then ran past 100 tokens for some seeds (seed 0 once the sampler changed), with no call parsed.
def search_docs(query: Annotated[Literal["decorators", "generators", "classes"],
                                 Field(description="What to look for.")]) -> str:
    """Search the Python documentation."""
    return "\n\n".join(n.get_content() for n in RETRIEVER.retrieve(query))


async def test_function_agent_calls_the_tool_and_the_next_step_reuses_the_first():
    llm = RecordingLLM(engine=fresh_engine(), max_new_tokens=100, temperature=1.0, seed=0)
    # One call per step: with parallel calls allowed (FunctionAgent's default), the forced grammar takes one or
    # more, and the random model may go on calling until its tokens run out.
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(search_docs)], llm=llm,
                          system_prompt="You answer questions about Python.", initial_tool_choice="search_docs",
                          allow_parallel_tool_calls=False)
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
