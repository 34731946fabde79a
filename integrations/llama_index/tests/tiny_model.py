"""The offline tiny Llama, built once per test session (or taken from PC_RAG_TINY_MODEL)."""

import functools
import os
import shutil
import tempfile
from pathlib import Path

from pc_rag import testing
from pc_rag.testing import build_tiny_llama


@functools.cache
def tiny_model_path() -> str:
    given = os.environ.get("PC_RAG_TINY_MODEL")
    if given:
        return given
    return str(build_tiny_llama(tempfile.mkdtemp(prefix="pc_rag_tiny_")))


@functools.cache
def template_less_model_path() -> str:
    """The tiny model without a chat template (as a base model ships): chat_template.jinja left out."""
    out = Path(tempfile.mkdtemp(prefix="pc_rag_tiny_base_")) / "model"
    shutil.copytree(tiny_model_path(), out, ignore=shutil.ignore_patterns("chat_template.jinja"))
    return str(out)


def fresh_engine():
    """An Engine on the session's tiny model with an empty memory-only store (nothing cached yet)."""
    return testing.fresh_engine(tiny_model_path())
