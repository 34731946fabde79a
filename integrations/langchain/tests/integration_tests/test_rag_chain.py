"""A stuff-chain RAG request on the tiny Llama, twice with the same documents.

Reference: `engine.generate(segments, mode="full")` for the very segments the chat model sent (greedy),
which computes every token fresh. The chat model runs in "exact" mode here, which reuses the longest cached
prefix and must give the same tokens: the answer text must be equal, not close. "modular" (the default)
relocates chunk KV computed on its own and is an approximation, so for it only the cache hit is checked.
"""

from pydoc_data.topics import topics

from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate, format_document
from langchain_core.retrievers import BaseRetriever
from langchain_pc_rag import ChatPromptCache, PromptCacheRetriever, register_documents
from langchain_pc_rag.chat_models import _message_dict

from pc_rag.adapters import chat_prompt
from pc_rag.segments import Chunk

from .tiny_model import tiny_model_path

TOPICS = ("assert", "break", "continue")
DOCS = [Document(page_content=topics[k][:500], metadata={"topic": k}) for k in TOPICS]
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer the question from the context.\n\n{context}"), ("human", "{input}")]
)


class ListRetriever(BaseRetriever):
    documents: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        return self.documents


def stuff(documents):
    # create_stuff_documents_chain's defaults: "{page_content}" per document, joined with "\n\n".
    return "\n\n".join(format_document(d, PromptTemplate.from_template("{page_content}")) for d in documents)


def rag_chain(llm, documents):
    retriever = PromptCacheRetriever(retriever=ListRetriever(documents=documents), llm=llm)
    return {"context": retriever | stuff, "input": lambda q: q} | PROMPT | llm


def sent_segments(llm, documents, question):
    messages = PROMPT.invoke({"context": stuff(documents), "input": question}).to_messages()
    return chat_prompt(llm._engine(), [_message_dict(m)[0] for m in messages])


def test_second_request_reads_cache_and_matches_full_mode():
    llm = ChatPromptCache(model=tiny_model_path(), mode="exact", max_tokens=12)
    chain = rag_chain(llm, DOCS)
    chain.invoke("What does assert do?")
    answer = chain.invoke("When is break used?")

    segments = sent_segments(llm, DOCS, "When is break used?")
    assert [s.text for s in segments if isinstance(s, Chunk)] == [d.page_content.strip() for d in DOCS]
    reference = llm._engine().generate(segments, mode="full", max_new_tokens=12)
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0
    assert answer.usage_metadata["input_tokens"] == reference.prompt_tokens
    assert answer.content == reference.text


def test_modular_reuses_documents_in_a_new_order():
    # Documents no earlier test sent: in the first request each is encoded on its own (computed, not
    # cached); in the second, in another order, each comes from the store at its new position.
    docs = [Document(page_content=topics[k][:400]) for k in ("while", "for", "if")]
    llm = ChatPromptCache(model=tiny_model_path(), max_tokens=4)
    first = rag_chain(llm, docs).invoke("What does while do?")
    answer = rag_chain(llm, docs[::-1]).invoke("What does while do?")
    ids = llm._engine().segmenter.ids
    chunk_tokens = sum(len(ids(d.page_content.strip())) for d in docs)
    first_usage = first.usage_metadata
    assert first_usage["input_tokens"] - first_usage["input_token_details"]["cache_read"] >= chunk_tokens
    assert answer.usage_metadata["input_token_details"]["cache_read"] >= chunk_tokens
    assert answer.response_metadata["mode"] == "modular"


def test_users_with_their_own_cache_salt_share_only_public_documents():
    """Issue 24: one engine, several users, each with a `cache_salt` (the field, a per-call keyword, or `bind`; a
    chain's `invoke` does not pass keywords to the model). Reference:
    a first request of the same prompt on this engine (nothing reused); the same user's second request (reuse
    unchanged within a namespace)."""
    from .tiny_model import fresh_engine

    engine = fresh_engine()
    private, public = (Document(page_content=topics[k][:400]) for k in ("pass", "import"))
    register_documents(ChatPromptCache(engine=engine), [public], public=True)
    alice = ChatPromptCache(engine=engine, mode="exact", max_tokens=2, cache_salt="alice")
    bob = ChatPromptCache(engine=engine, mode="exact", max_tokens=2, cache_salt="bob")

    def read(llm, documents):
        return rag_chain(llm, documents).invoke("What is it?").usage_metadata["input_token_details"]["cache_read"]

    assert read(alice, [private]) == 0
    assert read(bob, [private]) == 0  # alice's prompt, sent by bob: nothing reused
    messages = PROMPT.invoke({"context": stuff([private]), "input": "What is it?"}).to_messages()
    assert alice.invoke(messages, cache_salt="carol").usage_metadata["input_token_details"]["cache_read"] == 0
    assert bob.bind(cache_salt="alice").invoke(messages).usage_metadata["input_token_details"]["cache_read"] > 0
    assert read(alice, [private]) > 0  # alice's own reuse is unchanged
    # a public document (modular mode: chunks encoded on their own) is reused by every user; the prompt around it
    # is not
    read(ChatPromptCache(engine=engine, max_tokens=2, cache_salt="alice"), [public])
    public_tokens = len(engine.segmenter.ids(public.page_content.strip()))
    assert read(ChatPromptCache(engine=engine, max_tokens=2, cache_salt="dave"), [public]) == public_tokens
