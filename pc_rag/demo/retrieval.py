"""Text -> chunks -> a FAISS index to find the chunks for a question (the demo's and the examples' retriever).

    chunk_text      paragraphs packed into chunks of about `min_tokens`..`max_tokens` tokens
    corpus_chunks   Python's own documentation topics (pydoc_data.topics) as chunks
    read_documents  the .txt/.md files of a folder (or a list of files) as chunks
    VectorIndex     unit embeddings in a faiss IndexFlatIP (inner product = cosine), with the embedding
                    matrix cached on disk, keyed by the embedder and the exact chunk texts

Chunk sizes are counted with a tokenizer-free rule (words and punctuation marks), so the same text gives the
same chunks whatever model answers: the KV cache only hits when a chunk's text is identical, and
`pc-rag warm` must cut files the way the demo does. The rule is close to subword counts for English and code.

The index needs `faiss-cpu` (the `demo` extra); it is imported when an index is built.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..errors import PCRagError
from .embeddings import DEMO_EXTRA_HINT

TEXT_SUFFIXES = (".txt", ".md")
_TOKEN = re.compile(r"\w+|[^\w\s]")


def approx_tokens(text: str) -> int:
    """Words plus punctuation marks: a stand-in for a subword tokenizer's count."""
    return len(_TOKEN.findall(text))


def chunk_text(text: str, min_tokens: int = 100, max_tokens: int = 250,
               count: Callable[[str], int] = approx_tokens) -> list[str]:
    """Paragraphs (split at blank lines) packed in order into chunks of min_tokens..max_tokens.

    Consecutive paragraphs join (with a blank line) until a chunk reaches `min_tokens`; a paragraph that
    would take a chunk past `max_tokens` starts a new one; a single paragraph longer than `max_tokens` is cut
    at line breaks, then at spaces. Only the last chunk of a text may be shorter than `min_tokens`.
    """
    if not 0 < min_tokens <= max_tokens:
        raise PCRagError(f"chunk sizes need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    pieces = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n").rstrip()
        if para.strip():
            pieces += _split_long(para, max_tokens, count)
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for piece in pieces:
        n = count(piece)
        if current and (size >= min_tokens or size + n > max_tokens):
            chunks.append("\n\n".join(current))
            current, size = [], 0
        current.append(piece)
        size += n
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def _split_long(para: str, max_tokens: int, count: Callable[[str], int]) -> list[str]:
    if count(para) <= max_tokens:
        return [para]
    out: list[str] = []
    for sep in ("\n", " "):
        parts = para.split(sep)
        if len(parts) > 1:
            current = ""
            for part in parts:
                joined = current + sep + part if current else part
                if current and count(joined) > max_tokens:
                    out += _split_long(current, max_tokens, count)
                    current = part
                else:
                    current = joined
            return out + _split_long(current, max_tokens, count) if current else out
    return [para]  # one unbreakable word: leave it whole


def corpus_chunks(max_chunks: int | None = None, min_tokens: int = 100, max_tokens: int = 250) -> list[str]:
    """Python's documentation topics (shipped with CPython) cut into chunks, topics in sorted order."""
    from pydoc_data.topics import topics

    chunks = [c for key in sorted(topics) for c in chunk_text(topics[key], min_tokens, max_tokens)]
    return chunks[:max_chunks] if max_chunks is not None else chunks


def read_documents(paths: Iterable[str | os.PathLike], min_tokens: int = 100, max_tokens: int = 250) -> list[str]:
    """Chunks of every .txt/.md file named, or found (recursively, sorted) under each folder named."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix.lower() in TEXT_SUFFIXES and f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise PCRagError(f"{p}: no such file or folder")
    if not files:
        raise PCRagError(f"no .txt or .md files in {', '.join(map(str, paths))}")
    chunks = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise PCRagError(f"{f}: not UTF-8 text") from None
        chunks += chunk_text(text, min_tokens, max_tokens)
    return chunks


class VectorIndex:
    """Chunks and their unit embeddings in a faiss IndexFlatIP; `search(question, k)` -> the k best chunks."""

    def __init__(self, chunks: Sequence[str], vectors, embedder):
        try:
            import faiss
        except ImportError:
            raise PCRagError(f"faiss is not installed; {DEMO_EXTRA_HINT}") from None
        if len(chunks) != len(vectors):
            raise PCRagError(f"{len(chunks)} chunks but {len(vectors)} embeddings")
        self.chunks = list(chunks)
        self.vectors = vectors
        self.embedder = embedder
        self.index = faiss.IndexFlatIP(vectors.shape[1])  # exact search; vectors are unit: IP = cosine
        self.index.add(vectors)

    @classmethod
    def build(cls, chunks: Sequence[str], embedder, cache_dir: str | os.PathLike | None = None,
              progress: bool = False) -> VectorIndex:
        """Embed `chunks` (or load their embeddings from `cache_dir`, where they are saved for next time)."""
        import numpy as np

        path = None
        if cache_dir is not None:
            h = hashlib.blake2b(embedder.name.encode(), digest_size=16)
            for c in chunks:
                h.update(c.encode())
                h.update(b"\0")
            path = Path(cache_dir) / f"embeddings-{h.hexdigest()}.npy"
            if path.is_file():
                try:
                    vectors = np.load(path)
                    if vectors.shape == (len(chunks), embedder.dim):
                        return cls(chunks, vectors, embedder)
                except (OSError, ValueError):
                    pass  # damaged: embed again and overwrite
        vectors = _encode(embedder, chunks, progress)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, vectors)
                os.replace(tmp, path)
            except OSError:
                pass  # a cache that cannot be written only costs the next run the same embedding time
        return cls(chunks, vectors, embedder)

    def search(self, question: str, k: int = 4) -> list[tuple[str, float]]:
        """The k chunks most similar to `question`, best first, with their cosine similarity."""
        scores, ids = self.index.search(self.embedder.encode([question]), min(k, len(self.chunks)))
        return [(self.chunks[i], float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]


def _encode(embedder, chunks: Sequence[str], progress: bool):
    import numpy as np
    from tqdm.auto import tqdm

    step = 64
    parts = []
    with tqdm(total=len(chunks), desc="pc_rag: embedding chunks", unit="chunk", disable=not progress) as bar:
        for i in range(0, len(chunks), step):
            parts.append(embedder.encode(chunks[i: i + step]))
            bar.update(len(parts[-1]))
    return np.concatenate(parts) if parts else np.zeros((0, embedder.dim), dtype=np.float32)
