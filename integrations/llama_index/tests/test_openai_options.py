"""PromptCacheLLM with OpenAI's options (logprobs, penalties, logit_bias) and a forced call or JSON reply cut by
max_new_tokens, on the tiny Llama.

References: the engine's own reply to the same prompt with the same options (a fresh engine), token for token and
logprob for logprob; a cut reply raises ReplyCutError naming max_new_tokens, never returns the call's markup."""

from typing import Literal

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.pc_rag import PromptCacheLLM

from pc_rag.adapters import chat_prompt, completion_prompt
from pc_rag.errors import ReplyCutError

from .tiny_model import fresh_engine

PROMPT = "Question: what does the with statement do?\nAnswer:"


def get_weather(city: Literal["Paris", "Oslo"]) -> str:
    """Weather for a city."""
    return f"sunny in {city}"


def test_completion_and_chat_logprobs():
    llm = PromptCacheLLM(engine=fresh_engine(), max_new_tokens=8, logprobs=True, top_logprobs=2,
                         presence_penalty=1.0, logit_bias={9: 2.0})
    reference = fresh_engine()
    expected = reference.generate(completion_prompt(reference, PROMPT), max_new_tokens=8, logprobs=2,
                                  presence_penalty=1.0, logit_bias={9: 2.0})
    response = llm.complete(PROMPT)
    assert response.text == expected.text
    assert [per_token[0].token for per_token in response.logprobs] == [e.token for e in expected.logprobs]
    assert [per_token[0].logprob for per_token in response.logprobs] == pytest.approx(
        [e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(1 <= len(per_token) <= 3 for per_token in response.logprobs)  # the token, then the 2 most likely
    streamed = [lp for r in llm.stream_complete(PROMPT) for lp in r.logprobs or ()]
    assert [p[0].token for p in streamed] == [p[0].token for p in response.logprobs]
    messages = [{"role": "user", "content": "Why?"}]
    chat_expected = reference.generate(chat_prompt(reference, messages), max_new_tokens=8, logprobs=2,
                                       presence_penalty=1.0, logit_bias={9: 2.0})
    chat = llm.chat([ChatMessage(role="user", content="Why?")])
    assert chat.message.content == chat_expected.text
    assert [p[0].logprob for p in chat.logprobs] == pytest.approx([e.logprob for e in chat_expected.logprobs],
                                                                  abs=1e-4)
    assert PromptCacheLLM(engine=fresh_engine(), max_new_tokens=4).complete(PROMPT).logprobs is None


def test_a_cut_forced_call_raises_naming_max_new_tokens():
    tool = FunctionTool.from_defaults(get_weather)
    llm = PromptCacheLLM(engine=fresh_engine(), max_new_tokens=6)
    with pytest.raises(ReplyCutError, match="max_new_tokens=6"):
        llm.chat_with_tools([tool], user_msg="Weather?", tool_required=True)
    with pytest.raises(ReplyCutError, match="JSON reply"):
        llm.chat([ChatMessage(role="user", content="Weather?")], response_format={"type": "json_object"})
    roomy = PromptCacheLLM(engine=fresh_engine(), max_new_tokens=100)
    response = roomy.chat_with_tools([tool], user_msg="Weather?", tool_required=True)
    assert roomy.get_tool_calls_from_response(response)[0].tool_kwargs["city"] in ("Paris", "Oslo")


async def test_a_function_agent_whose_call_is_cut_fails_with_that_error():
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(get_weather)], initial_tool_choice="get_weather",
                          llm=PromptCacheLLM(engine=fresh_engine(), max_new_tokens=6))
    with pytest.raises(Exception) as caught:
        await agent.run(user_msg="Weather?")
    chain, error = [], caught.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, ReplyCutError) for e in chain), chain
