"""Shared fixtures: the offline tiny Llama is built once per test session and loaded through from_pretrained."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "PC_RAG_CACHE_DIR" not in os.environ:  # engines built with the default store must not write to ~/.cache
    import tempfile

    os.environ["PC_RAG_CACHE_DIR"] = tempfile.mkdtemp(prefix="pc_rag_test_cache_")

import pc_rag  # noqa: E402
from pc_rag.store import MemoryStore  # noqa: E402

DOCS_SEED_KEYS = (3, 7, 11, 19)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return pc_rag.testing.build_tiny_llama(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def loaded(tiny_path):
    base = pc_rag.Engine.from_pretrained(tiny_path)
    return base.model, base.tokenizer


@pytest.fixture
def engine(loaded):
    """A fresh engine (empty store) over the session's loaded model."""
    model, tok = loaded
    return pc_rag.Engine(model, tok, store=MemoryStore())


@pytest.fixture(scope="session")
def docs():
    """Real text chunks: slices of Python's own documentation topics."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return [topics[keys[i]][:500] for i in DOCS_SEED_KEYS]


def prompt_ids(engine, prompt):
    """The prompt's token ids in order, as the engine lays them out (the reference forward's input)."""
    return [t for s in engine.segmenter.segments(prompt) for t in s.token_ids]
