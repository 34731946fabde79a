"""PromptCacheLLM when the app formats the documents into its prompt itself (`complete` with its own template,
`chat` with its own system message; no retriever, node postprocessor or registration): the documents are reused
at any position from the second request on.

Reference: the documents' own token counts (what the second request, with them in another order, must read from
the cache), and the same prompt answered by an engine that registered those documents (greedy, the
registered-chunk path): the same text."""

from pydoc_data.topics import topics

from llama_index.core.llms import ChatMessage
from llama_index.llms.pc_rag import PromptCacheLLM

from .tiny_model import fresh_engine

DOCS = [" ".join(topics[k].split())[:450] for k in ("global", "nonlocal", "del", "raise")]


def prompt(order, question):
    context = "\n".join(f"[{n}] {DOCS[i]}" for n, i in enumerate(order, 1))
    return f"Context:\n{context}\n\nAnswer the question from the context.\nQuestion: {question}\nAnswer: "


def test_complete_reuses_documents_the_app_formatted_itself():
    engine = fresh_engine()
    llm = PromptCacheLLM(engine=engine, max_new_tokens=6)
    first = llm.complete(prompt([0, 1, 2], "What is global?"))
    assert first.raw["usage"]["cached_tokens"] == 0
    second = llm.complete(prompt([2, 3, 0], "What is del?"))
    # "[n] " before each document: its first token is " The..."-like, as it was the first time (same label form).
    reused = sum(len(s.token_ids) for s in engine.split(prompt([2, 3, 0], "?")) if s.passage
                 and s.text.strip() in (DOCS[2], DOCS[0]))
    assert reused > 150 and second.raw["usage"]["cached_tokens"] >= reused
    reference = fresh_engine()
    reference.register([DOCS[2], DOCS[0]])
    assert PromptCacheLLM(engine=reference, max_new_tokens=6).complete(prompt([2, 3, 0], "What is del?")).text \
        == second.text


def test_chat_reuses_documents_in_the_apps_own_system_message():
    engine = fresh_engine()
    llm = PromptCacheLLM(engine=engine, max_new_tokens=4)

    def ask(order, question):
        system = "Use these notes.\n\n" + "\n\n---\n\n".join(DOCS[i] for i in order)
        return llm.chat([ChatMessage(role="system", content=system), ChatMessage(role="user", content=question)])

    ask([0, 1], "first?")
    second = ask([3, 1, 0], "second?")
    reused = sum(len(engine.segmenter.ids(DOCS[i])) for i in (1, 0))
    assert second.raw["usage"]["cached_tokens"] >= reused
