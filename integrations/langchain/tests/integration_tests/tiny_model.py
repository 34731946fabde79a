"""The offline tiny Llama, built once per test session (or taken from PC_RAG_TINY_MODEL)."""

import functools
import os
import tempfile

from pc_rag import testing
from pc_rag.testing import build_tiny_llama


@functools.cache
def tiny_model_path() -> str:
    given = os.environ.get("PC_RAG_TINY_MODEL")
    if given:
        return given
    return str(build_tiny_llama(tempfile.mkdtemp(prefix="pc_rag_tiny_")))


def fresh_engine():
    """An Engine on the session's tiny model with an empty memory-only store (nothing cached yet)."""
    return testing.fresh_engine(tiny_model_path())
