"""A stock LangChain retrieval chain on the tiny Llama with only the LLM class swapped: documents are reused.

The chain is `create_retrieval_chain` + `create_stuff_documents_chain` (langchain_classic), untouched; usage is
read the way users read it, with langchain-core's `get_usage_metadata_callback`. Reference for the reuse: the
documents' own token counts (the tokenizer on their stripped text, as the splitter sends them). Each test
starts from an engine with an empty store, so what the second request reads was stored by the first.
"""

from pydoc_data.topics import topics

import pytest
from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_pc_rag import ChatPromptCache

from pc_rag.adapters import completion_prompt
from pc_rag.segments import Chunk

from .tiny_model import fresh_engine

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer the question from the context.\n\n{context}"), ("human", "{input}")]
)
TOPICS = {
    "invoke": ("try", "with", "import"),
    "ainvoke": ("class", "function", "return"),
    "stream": ("global", "nonlocal", "pass"),
    "astream": ("del", "raise", "yield"),
}


class ListRetriever(BaseRetriever):
    documents: list[Document]

    def _get_relevant_documents(self, query, *, run_manager):
        return self.documents


async def ask(llm, documents, how, question="What does it do?"):
    """One run of the stock chain; the usage langchain-core's callback collected for it."""
    chain = create_retrieval_chain(ListRetriever(documents=documents), create_stuff_documents_chain(llm, PROMPT))
    inputs = {"input": question}
    with get_usage_metadata_callback() as callback:
        if how == "invoke":
            chain.invoke(inputs)
        elif how == "ainvoke":
            await chain.ainvoke(inputs)
        elif how == "stream":
            list(chain.stream(inputs))
        else:
            [part async for part in chain.astream(inputs)]
    return callback.usage_metadata[llm.model_name]


def token_count(engine, documents):
    return sum(len(engine.segmenter.ids(d.page_content.strip())) for d in documents)


@pytest.mark.parametrize("how", list(TOPICS))
async def test_stock_chain_reuses_retrieved_documents_in_a_new_order(how):
    engine = fresh_engine()
    docs = [Document(page_content=topics[k][:400], metadata={"topic": k}) for k in TOPICS[how]]
    llm = ChatPromptCache(engine=engine, max_tokens=4)  # modular, auto_chunks: the defaults

    first = await ask(llm, docs, how)
    # Discovered: any engine's split now finds the documents (a string holding them, no template around).
    found = completion_prompt(fresh_engine(), "\n\n".join(d.page_content for d in docs))
    assert [s.text for s in found if isinstance(s, Chunk)] == [d.page_content.strip() for d in docs]

    second = await ask(llm, docs[::-1], how)
    doc_tokens = token_count(engine, docs)
    assert first["input_token_details"]["cache_creation"] >= doc_tokens  # encoded and stored by the first
    assert second["input_token_details"]["cache_read"] >= doc_tokens  # every document, at its new place
    assert second["input_tokens"] > second["input_token_details"]["cache_read"]  # the question is fresh


def test_auto_chunks_off_reuses_no_document():
    # The same run with discovery ignored: the reversed order leaves only the exact prefix (the template and
    # system text before the first document), which is shorter than any one document.
    engine = fresh_engine()
    docs = [Document(page_content=topics[k][:400]) for k in ("lambda", "assert", "while")]
    llm = ChatPromptCache(engine=engine, max_tokens=4, auto_chunks=False)
    with get_usage_metadata_callback() as callback:
        for order in (docs, docs[::-1]):
            chain = create_retrieval_chain(ListRetriever(documents=order), create_stuff_documents_chain(llm, PROMPT))
            chain.invoke({"input": "What does it do?"})
            usage = dict(callback.usage_metadata[llm.model_name]["input_token_details"])
            callback.usage_metadata.clear()
    assert usage["cache_read"] < min(token_count(engine, [d]) for d in docs)
