from langchain_pc_rag import __all__

EXPECTED_ALL = ["ChatPromptCache", "PromptCacheLLM", "PromptCacheRetriever", "register_documents"]


def test_all_imports() -> None:
    assert sorted(EXPECTED_ALL) == sorted(__all__)
