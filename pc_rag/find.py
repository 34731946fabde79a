"""Kept for earlier imports: the text indexes now live in pc_rag.text_index (a name that says what it holds)."""

from .text_index import (
    DISCOVERED,
    DISCOVERY,
    ChunkIndex,
    Discovery,
    ReplyIndex,
    Span,
    discover,
    discovery_enabled,
    index_for,
    marked,
    resolve,
)

__all__ = ["DISCOVERED", "DISCOVERY", "ChunkIndex", "Discovery", "ReplyIndex", "Span", "discover",
           "discovery_enabled", "index_for", "marked", "resolve"]
