"""pc_rag: reuse the attention KV of document chunks across RAG requests on a local Llama."""

from . import testing
from .blocks import KVBlock
from .engine import Engine
from .errors import (
    CheckpointError,
    GrammarError,
    OptionError,
    OptionTypeError,
    PCRagError,
    PMLError,
    PromptError,
    StoreError,
    UnsupportedModelError,
)
from .explain import ExplainRow, Explanation
from .grammar import Grammar
from .options import GenerationOptions
from .pml import PML, Schema, SchemaRegistry
from .request import Generation, SegmentSource
from .segments import Chunk, Text

__all__ = [
    "CheckpointError",
    "Chunk",
    "Engine",
    "ExplainRow",
    "Explanation",
    "Generation",
    "GenerationOptions",
    "Grammar",
    "GrammarError",
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
