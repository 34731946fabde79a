"""pc_rag: reuse the attention KV of document chunks across RAG requests on a local Llama."""

from . import testing
from .blocks import KVBlock
from .errors import PCRagError, PMLError, PromptError, StoreError, UnsupportedModelError
from .pml import Schema, SchemaRegistry
from .segments import Chunk, Text

__all__ = [
    "Chunk",
    "KVBlock",
    "PCRagError",
    "PMLError",
    "PromptError",
    "Schema",
    "SchemaRegistry",
    "StoreError",
    "Text",
    "UnsupportedModelError",
    "testing",
]
