"""pc_rag: reuse the attention KV of document chunks across RAG requests on a local Llama."""

from . import testing
from .blocks import KVBlock
from .engine import Engine, ExplainRow, Explanation, Generation, SegmentSource
from .errors import OptionError, OptionTypeError, PCRagError, PMLError, PromptError, StoreError, UnsupportedModelError
from .options import GenerationOptions
from .pml import PML, Schema, SchemaRegistry
from .segments import Chunk, Text

__all__ = [
    "Chunk",
    "Engine",
    "ExplainRow",
    "Explanation",
    "Generation",
    "GenerationOptions",
    "KVBlock",
    "OptionError",
    "OptionTypeError",
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
