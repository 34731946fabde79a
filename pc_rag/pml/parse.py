"""PML parsing: text → a small element tree (safe XML via defusedxml), and the name and attribute checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from xml.etree.ElementTree import ParseError

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import DefusedXMLParser

from ..errors import PMLError
from ..segments import INVALID_TEXT_HINT, lone_surrogate

ROLE_TAGS = ("system", "user", "assistant")
_STRUCTURE_TAGS = ("schema", "prompt", "module", "parameter", "union", "scaffold")
_RESERVED_NAMES = frozenset(ROLE_TAGS + _STRUCTURE_TAGS)
# Module names become tag names in prompts: a conservative subset of XML names, short enough to print.
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}\Z")
MAX_DEPTH = 64


@dataclass(eq=False)
class _TextRun:
    text: str
    line: int


@dataclass(eq=False)
class _Node:
    tag: str
    attrs: dict[str, str]
    line: int
    content: list[_Node | _TextRun] = field(default_factory=list)

    def describe(self) -> str:
        name = self.attrs.get("name")
        shown = f'<{self.tag} name="{name[:40]}">' if isinstance(name, str) else f"<{self.tag}>"
        return f"{shown} at line {self.line}"

    def children(self) -> list[_Node]:
        return [c for c in self.content if isinstance(c, _Node)]

    def texts(self) -> list[_TextRun]:
        """Text runs that are not layout (whitespace-only runs with a line break are indentation)."""
        return [c for c in self.content if isinstance(c, _TextRun) and not _is_layout(c.text)]


def _is_layout(text: str) -> bool:
    return text.isspace() and ("\n" in text or "\r" in text)


class _TreeBuilder:
    """Target for the expat-based parser: builds `_Node`s with line numbers and mixed content."""

    def __init__(self):
        self.expat = None  # set once the parser exists; line numbers come from it
        self.stack: list[_Node] = []
        self.root: _Node | None = None

    def _line(self) -> int:
        return self.expat.CurrentLineNumber if self.expat is not None else 0

    def start(self, tag, attrs):
        if len(self.stack) >= MAX_DEPTH:
            raise PMLError(f"<{tag}> at line {self._line()} is nested more than {MAX_DEPTH} elements deep")
        node = _Node(tag, dict(attrs), self._line())
        if self.stack:
            self.stack[-1].content.append(node)
        else:
            self.root = node
        self.stack.append(node)

    def end(self, tag):
        self.stack.pop()

    def data(self, text):
        if not self.stack:
            return
        content = self.stack[-1].content
        if content and isinstance(content[-1], _TextRun):
            content[-1].text += text  # expat delivers text in pieces
        else:
            content.append(_TextRun(text, self._line()))

    def close(self):
        return self.root


def parse_pml(text: str, *, max_chars: int, what: str) -> _Node:
    """Parse PML text into a tree; every failure is a PMLError. `what` ("schema"/"prompt") names the input."""
    if not isinstance(text, str):
        raise PMLError(f"a PML {what} is a str, not {type(text).__name__}")
    if len(text) > max_chars:
        head = re.match(r"\s*<([A-Za-z_][\w.-]{0,40})", text[:200])
        where = f"<{head.group(1)}> starting at line 1" if head else "the input starting at line 1"
        raise PMLError(
            f"PML {what} is {len(text):,} characters, over the {max_chars:,} limit ({where}); "
            f"raise the registry's max_{what}_chars if this input is legitimate"
        )
    at = lone_surrogate(text)
    if at is not None:  # expat would refuse the whole text, naming no place
        line, column = text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1)
        raise PMLError(f"PML {what} at line {line}, column {column} holds a lone surrogate {text[at]!r}, "
                       f"{INVALID_TEXT_HINT}")
    builder = _TreeBuilder()
    parser = DefusedXMLParser(target=builder, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    builder.expat = parser.parser
    try:
        parser.feed(text)
        root = parser.close()
    except PMLError:
        raise
    except ParseError as e:
        line, col = getattr(e, "position", (builder._line(), 0))
        where = f" inside {builder.stack[-1].describe()}" if builder.stack else ""
        raise PMLError(f"malformed PML {what} at line {line}, column {col}{where}: {e}") from None
    except DefusedXmlException as e:
        thing = f"<!DOCTYPE {e.name}>" if getattr(e, "name", None) else "a declaration"
        raise PMLError(
            f"{thing} at line {builder._line()} of the PML {what}: {type(e).__name__}; DTDs, entity "
            "declarations and external references are not allowed "
            "(no entity expansion, no file or network access)"
        ) from None
    except (ValueError, UnicodeError, OverflowError) as e:  # what expat refuses beyond the checks above
        raise PMLError(f"PML {what} at line {builder._line()} cannot be parsed: {e}") from None
    if root is None:
        raise PMLError(f"PML {what} has no root element")
    return root


def _check_attrs(node: _Node, allowed: tuple[str, ...]) -> None:
    for key in node.attrs:
        if key not in allowed:
            allowed_txt = ", ".join(allowed) if allowed else "no attributes"
            raise PMLError(f"{node.describe()}: unknown attribute {key[:40]!r} (allowed: {allowed_txt})")


def _check_name(node: _Node, value: str | None, what: str) -> str:
    if value is None:
        raise PMLError(f"{node.describe()} needs a {what} attribute")
    if not _NAME_RE.match(value) or value in _RESERVED_NAMES:
        raise PMLError(
            f"{node.describe()}: {what} {value[:40]!r} is not usable; use letters, digits, '_', '-', '.' "
            f"(starting with a letter or '_', at most 128 characters, not a PML tag name)"
        )
    return value
