"""pc_rag: reuse the attention KV of document chunks across RAG requests on a local Llama."""

from . import testing
from .blocks import KVBlock
from .engine import Engine, Generation, SegmentSource
from .errors import PCRagError, PMLError, PromptError, StoreError, UnsupportedModelError
from .pml import PML, Schema, SchemaRegistry
from .segments import Chunk, Text

__all__ = [
    "Chunk",
    "Engine",
    "Generation",
    "KVBlock",
    "PCRagError",
    "PML",
    "PMLError",
    "PromptError",
    "Schema",
    "SchemaRegistry",
    "SegmentSource",
    "StoreError",
    "Text",
    "UnsupportedModelError",
    "testing",
]
