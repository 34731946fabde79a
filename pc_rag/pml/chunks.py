"""PML helpers for plain chunk lists: a schema with one module per chunk, and a prompt importing some of them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from xml.sax.saxutils import escape

from ..errors import PMLError
from .parse import _NAME_RE, _RESERVED_NAMES

# XML 1.0 cannot carry these characters even as references; `\r` is kept by writing it as `&#13;`.
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def escape_text(text: str, where: str = "text") -> str:
    """Escape document text for PML element content: `&`, `<`, `>` become references, `\\r` survives."""
    bad = _XML_ILLEGAL.search(text)
    if bad:
        raise PMLError(
            f"{where} contains the control character U+{ord(bad.group()):04X} at offset {bad.start()}, "
            "which XML "
            f"cannot carry even escaped; remove or replace it"
        )
    return escape(text).replace("\r", "&#13;")


def chunk_module_name(index: int) -> str:
    return f"chunk-{index}"


def schema_for_chunks(name: str, chunks: Sequence[str], *, separator: str = "\n\n") -> str:
    """A schema with one module per chunk (`chunk-0`, `chunk-1`, ...): each chunk's text, then `separator`.

    Document text is escaped, so `<`, `>` and `&` in documents are plain text, never markup.
    """
    if not _NAME_RE.match(name) or name in _RESERVED_NAMES:
        raise PMLError(f"schema name {name[:40]!r} is not usable; use letters, digits, '_', '-', '.'")
    parts = [f'<schema name="{name}">']
    for i, text in enumerate(chunks):
        if not isinstance(text, str):
            raise PMLError(f"chunk {i} is a {type(text).__name__}, not str")
        body = escape_text(text + separator, where=f"chunk {i}")
        parts.append(f'<module name="{chunk_module_name(i)}">{body}</module>')
    parts.append("</schema>")
    return "".join(parts)


def prompt_for(
    schema_name: str, module_names_or_indices: Sequence[str | int], question: str, *, chat: bool = False
) -> str:
    """A prompt importing the given modules, then the question (escaped). Indices name `chunk-i` modules.

    Indices are sorted (imports follow schema order); names are kept in the order given. `chat=True` wraps
    the question in `<user>` and ends with an open `<assistant/>` turn.
    """
    module_names_or_indices = list(module_names_or_indices)
    names = [m for m in module_names_or_indices if not isinstance(m, int)]
    indices = sorted(m for m in module_names_or_indices if isinstance(m, int))
    if names and indices:
        raise PMLError("prompt_for takes module names or chunk indices, not a mix")
    tags = [chunk_module_name(i) for i in indices] if indices else names
    for t in tags:
        if not isinstance(t, str) or not _NAME_RE.match(t) or t in _RESERVED_NAMES:
            raise PMLError(f"module name {str(t)[:40]!r} is not usable in a prompt")
    if not _NAME_RE.match(schema_name):
        raise PMLError(f"schema name {schema_name[:40]!r} is not usable")
    q = escape_text(question, where="the question")
    tail = f"<user>{q}</user><assistant/>" if chat else q
    return f'<prompt schema="{schema_name}">' + "".join(f"<{t}/>" for t in tags) + tail + "</prompt>"
