"""PML, the Prompt Markup Language of Prompt Cache (Gim et al., MLSys 2024): schemas and prompts → segments.

A *schema* declares reusable text once; a *prompt* picks parts of it and adds fresh text:

    <schema name="legal">
      <system>You are a lawyer.</system>
      <module name="contract">Contract text ...</module>
      <module name="statute">Statute text ...</module>
      <module name="letter">Dear <parameter name="client" length="4"/>, about your case</module>
      <union scaffold="en">
        <module name="en">Answer in English.</module>
        <module name="fr">Answer in French.</module>
      </union>
    </schema>

    <prompt schema="legal"><contract/><letter client="Ms Smith"/><fr/>
      <user>Can I cancel?</user><assistant/></prompt>

`SchemaRegistry.segments(prompt)` turns a prompt into the `Text` / `Chunk` list the engine runs.

Text. Text directly in `<schema>` is always included. Module text is cached: each run of module text between
parameters and child modules becomes one `Chunk`. Parameter arguments and all prompt text are fresh `Text`.
Text is used verbatim, except that a run made only of whitespace that contains a line break is layout
(indentation between tags) and is dropped; write `<module name="m">text</module>` on one line when you do
not want line breaks in your tokens.

Positions. The schema is laid out once: a BOS sink at 0 when the tokenizer has one, then every piece in
document order, union members all starting at the union's start (the union takes its longest member's
length), a parameter reserving `length` positions. A module's KV is always encoded at its schema position
(`Chunk.encode_position`), so it is the same cache entry whatever prompt uses it. Where a prompt puts it:

* schema layout (the paper's): imported pieces keep their schema positions, so a prompt that imports a
  subset has gaps; fresh text goes right after the last segment before it. Used when the schema is no
  longer than `schema_budget` positions (default: half of `max_positions`, leaving the other half for the
  question and the answer) and the prompt's fresh text does not run into the positions of a module
  imported after it.
* compact layout: otherwise (e.g. a RAG schema of thousands of chunks, far longer than the context).
  Everything the prompt uses is packed in order from the start, each piece relocated from its schema
  position (`position` = packed position, `encode_position` = schema position; the core's RoPE rotation
  moves the cached keys). Parameters keep their reserved width, so offsets inside a module are the same
  in both layouts. The fresh text then follows the last imported module, whatever the schema's size.

Either way a prompt that ends past `max_positions` is a `PMLError`.

Order. Imports must appear in schema order (the schema fixes where cached text sits). Free text is never
dropped: written after an import (or at the start), it follows that import and any always-included schema
text up to the next imported module.

Chat roles. `<system>`, `<user>` and `<assistant>` are rendered through the tokenizer's own chat template,
not hard-coded per model: `chat_roles` renders a conversation whose contents are placeholders with
`apply_chat_template` and cuts the text around the placeholders into each role's prefix and suffix (the
generation prompt gives the assistant prefix). A template that trims message contents gets trimmed role
contents here too. In a prompt, a final `<assistant>` element (`<assistant/>` or with a prefilled start) is
left open so the model writes the reply. PML renders only the turns written: a template's implicit default
system message is not added.

Unions. A prompt imports at most one member. `scaffold="member"` is parsed and recorded
(`Schema.unions`), but members are still each encoded on their own (members share their start position,
so "the scaffold member as context" has no single meaning for RoPE; left for later).

Scaffolds. `<scaffold><module .../><module .../></scaffold>` groups modules that are retrieved together:
the layout is as without it, and when a prompt imports the members in order, the engine encodes them
jointly once (each member sees the ones before it) and reuses that block; a member imported alone uses its
own block.

Safety. Parsing uses defusedxml with DTDs, entity declarations and external references forbidden, so entity
expansion and file or network access cannot happen; input over a size cap is refused before parsing.
Every problem is a `pc_rag.PMLError` naming the element and line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.etree.ElementTree import ParseError
from xml.sax.saxutils import escape

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import DefusedXMLParser

from .errors import PMLError
from .segments import Chunk, SegmentTokenizer, Text

ROLE_TAGS = ("system", "user", "assistant")
_STRUCTURE_TAGS = ("schema", "prompt", "module", "parameter", "union", "scaffold")
_RESERVED_NAMES = frozenset(ROLE_TAGS + _STRUCTURE_TAGS)
# Module names become tag names in prompts: a conservative subset of XML names, short enough to print.
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}\Z")
MAX_DEPTH = 64
# XML 1.0 cannot carry these characters even as references; `\r` is kept by writing it as `&#13;`.
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


# ---------------------------------------------------------------- parsing: text → a small element tree


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
    except (ValueError, UnicodeError, OverflowError) as e:  # e.g. lone surrogates cannot be encoded for expat
        raise PMLError(f"PML {what} at line {builder._line()} cannot be parsed: {e}") from None
    if root is None:
        raise PMLError(f"PML {what} has no root element")
    return root


# ---------------------------------------------------------------- chat roles from the tokenizer's template


@dataclass(frozen=True)
class ChatRoles:
    """Text around each role's content, cut out of the tokenizer's own chat template."""

    prefix: dict[str, str]
    suffix: dict[str, str]
    trims: bool  # the template strips whitespace around contents

    def wrap(self, role: str, where: str) -> tuple[str, str]:
        if role not in self.prefix:
            raise PMLError(f"{where}: this tokenizer's chat template has no <{role}> role")
        return self.prefix[role], self.suffix[role]


_PH = {"system": "pmlSYSTEMpml", "user": "pmlUSERpml", "assistant": "pmlASSISTANTpml", "user2": "pmlUSER2pml"}


def chat_roles(tokenizer) -> ChatRoles | None:
    """Derive role prefixes/suffixes by rendering placeholder conversations; None when there is no template.

    From [system A, user B, assistant C, user D]: text before A is the system prefix; the generation prompt
    (rendering with and without `add_generation_prompt`) is the assistant prefix; the assistant suffix is
    what follows C when C is last; the rest is cut accordingly. A leading BOS string is removed: the BOS sink
    comes from the segment layout. A template that refuses a system message gives user/assistant only.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    bos = getattr(tokenizer, "bos_token", None) or ""

    def render(messages, gen=False) -> str:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        return out[len(bos) :] if bos and out.startswith(bos) else out

    def msg(role, key=None):
        return {"role": role, "content": _PH[key or role]}

    def between(text, a, b):
        i, j = text.index(_PH[a]) + len(_PH[a]), text.index(_PH[b])
        if j < i:
            raise ValueError("placeholders out of order")
        return text[i:j]

    try:
        with_system = True
        try:
            r3 = render([msg("system"), msg("user"), msg("assistant")])
        except Exception:  # the template rejects system messages (raise_exception in Jinja)
            with_system = False
        head = [msg("system")] if with_system else []
        r3 = render([*head, msg("user"), msg("assistant")])
        r4 = render([*head, msg("user"), msg("assistant"), msg("user", "user2")])
        plain = render([*head, msg("user")])
        gen_full = render([*head, msg("user")], gen=True)
        if not gen_full.startswith(plain):
            raise ValueError("generation prompt is not an extension of the conversation")
        asst_prefix = gen_full[len(plain) :]
        asst_suffix = r3[r3.index(_PH["assistant"]) + len(_PH["assistant"]) :]
        c_to_d = between(r4, "assistant", "user2")
        if not c_to_d.startswith(asst_suffix):
            raise ValueError("assistant suffix differs mid-conversation")
        user_prefix = c_to_d[len(asst_suffix) :]
        b_to_c = between(r3, "user", "assistant")
        if not b_to_c.endswith(asst_prefix):
            raise ValueError("assistant prefix differs mid-conversation")
        user_suffix = b_to_c[: len(b_to_c) - len(asst_prefix)]
        prefix = {"user": user_prefix, "assistant": asst_prefix}
        suffix = {"user": user_suffix, "assistant": asst_suffix}
        if with_system:
            a_to_b = between(r3, "system", "user")
            if not a_to_b.endswith(user_prefix):
                raise ValueError("user prefix differs after a system message")
            prefix["system"] = r3[: r3.index(_PH["system"])]
            suffix["system"] = a_to_b[: len(a_to_b) - len(user_prefix)]
        spaced = render([{"role": "user", "content": " " + _PH["user"] + " "}])
        trims = (" " + _PH["user"] + " ") not in spaced
    except Exception as e:  # any template we cannot cut apart: role tags then fail with this reason
        raise PMLError(f"cannot derive chat roles from this tokenizer's chat template: {e}") from None
    return ChatRoles(prefix, suffix, trims)


# ---------------------------------------------------------------- schemas


@dataclass(frozen=True)
class Piece:
    """One laid-out part of a schema: a run of cached text, or a parameter's reserved positions."""

    kind: str  # "text" | "param"
    owner: tuple[str, ...]  # path of the innermost module holding it; () = always included
    start: int  # schema position of its first token
    length: int  # tokens (text) or reserved positions (param)
    text: str = ""  # text pieces
    name: str = ""  # param pieces
    line: int = 0


@dataclass(frozen=True)
class ModuleInfo:
    path: tuple[str, ...]
    line: int
    order: int  # pre-order index in the schema: imports must follow it
    start: int
    end: int
    params: tuple[str, ...]
    union: int | None  # index into Schema.unions when the module is a union member


@dataclass(frozen=True)
class UnionInfo:
    members: tuple[tuple[str, ...], ...]
    scaffold: str | None  # recorded only; members are encoded on their own for now
    line: int


@dataclass(frozen=True)
class Schema:
    """A registered schema: its pieces at schema positions. Module KV is encoded lazily by the engine."""

    name: str
    source: str
    length: int  # one past the last schema position (includes the BOS sink position when there is one)
    pieces: tuple[Piece, ...]
    modules: dict[tuple[str, ...], ModuleInfo]
    unions: tuple[UnionInfo, ...]
    scaffolds: tuple[tuple[tuple[str, ...], ...], ...] = ()  # <scaffold> groups: member module paths

    def scaffold_texts(self) -> list[list[str]]:
        """Each <scaffold> group's cached text pieces, in schema order (what the engine encodes jointly)."""
        groups = []
        for members in self.scaffolds:
            inside = [p.text for p in self.pieces
                      if p.kind == "text" and any(p.owner[: len(m)] == m for m in members)]
            groups.append(inside)
        return groups

    def chunks(self) -> list[Chunk]:
        """Every cached piece as a Chunk at its schema position (e.g. to encode a schema ahead of use)."""
        return [
            Chunk(p.text, position=p.start, encode_position=p.start) for p in self.pieces if p.kind == "text"
        ]


@dataclass
class _Param:
    name: str
    length: int
    line: int


@dataclass
class _Union:
    members: list[_Module]
    scaffold: str | None
    line: int


@dataclass
class _Module:
    name: str
    path: tuple[str, ...]
    line: int
    body: list[str | _Param | _Module | _Union] = field(default_factory=list)


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


class _SchemaReader:
    def __init__(self, roles_fn, max_positions: int):
        self.roles_fn = roles_fn
        self.max_positions = max_positions
        self.scaffolds: list[tuple[tuple[str, ...], ...]] = []

    def read(self, root: _Node) -> tuple[str, _Module]:
        if root.tag != "schema":
            raise PMLError(f"a schema's root element must be <schema name=...>, found {root.describe()}")
        _check_attrs(root, ("name",))
        name = _check_name(root, root.attrs.get("name"), "name")
        top = _Module(name="", path=(), line=root.line)
        top.body = self.body(root, (), {}, None, in_role=False)
        return name, top

    def body(self, node, path, scope: dict, params: dict | None, in_role: bool) -> list:
        items: list = []
        for c in node.content:
            if isinstance(c, _TextRun):
                if not _is_layout(c.text):
                    items.append(c.text)
            elif c.tag == "module":
                items.append(self.module(c, path, scope))
            elif c.tag == "parameter":
                if params is None:
                    raise PMLError(f"{c.describe()}: a <parameter> must be inside a <module>")
                items.append(self.parameter(c, params))
            elif c.tag == "union":
                items.append(self.union(c, path, scope))
            elif c.tag == "scaffold":
                # Transparent for layout: its modules sit where they would without it; the group is recorded
                # so the engine encodes the members jointly when a prompt imports them together, in order.
                _check_attrs(c, ())
                for t in c.texts():
                    if t.text.strip():
                        raise PMLError(f"{c.describe()}: text {t.text.strip()[:30]!r} at line {t.line}; "
                                       "a scaffold holds only modules")
                members = []
                for m in c.children():
                    if m.tag != "module":
                        raise PMLError(f"{m.describe()}: a <scaffold> holds only <module> elements")
                    members.append(self.module(m, path, scope))
                if len(members) < 2:
                    raise PMLError(f"{c.describe()}: a scaffold groups at least two modules")
                self.scaffolds.append(tuple(m.path for m in members))
                items += members
            elif c.tag in ROLE_TAGS:
                if in_role:
                    raise PMLError(f"{c.describe()}: role tags cannot be nested inside another role tag")
                _check_attrs(c, ())
                prefix, suffix = self.roles_fn(c.tag, c.describe())
                inner = self.body(c, path, scope, params, in_role=True)
                if self.roles_fn.trims:
                    inner = _trim_edges(inner)
                items += [prefix, *inner, suffix]
            elif c.tag in ("schema", "prompt"):
                raise PMLError(f"{c.describe()}: a <{c.tag}> cannot be nested inside {node.describe()}")
            else:
                raise PMLError(
                    f"{c.describe()}: unknown element in a schema (expected module, parameter, union, "
                    f"scaffold, system, user or assistant)"
                )
        return _merge_text(items)

    def module(self, node: _Node, path, scope: dict) -> _Module:
        _check_attrs(node, ("name",))
        name = _check_name(node, node.attrs.get("name"), "name")
        if name in scope:
            raise PMLError(
                f"{node.describe()}: duplicate module name {name!r} (first defined at line {scope[name]})"
            )
        scope[name] = node.line
        mod = _Module(name, (*path, name), node.line)
        mod.body = self.body(node, mod.path, {}, {}, in_role=False)
        return mod

    def parameter(self, node: _Node, params: dict) -> _Param:
        _check_attrs(node, ("name", "length", "len"))
        name = _check_name(node, node.attrs.get("name"), "name")
        if name in params:
            raise PMLError(
                f"{node.describe()}: duplicate parameter {name!r} (first defined at line {params[name]})"
            )
        params[name] = node.line
        if node.content:
            raise PMLError(f"{node.describe()}: a <parameter/> is empty; its value comes from the prompt")
        if "length" in node.attrs and "len" in node.attrs:
            raise PMLError(f"{node.describe()}: give length or len, not both")
        raw = node.attrs.get("length", node.attrs.get("len"))
        if raw is None:
            raise PMLError(f'{node.describe()} needs length="N": the number of token positions it reserves')
        if not re.fullmatch(r"[0-9]{1,9}", raw.strip()) or not 0 < int(raw) <= self.max_positions:
            raise PMLError(
                f"{node.describe()}: length={raw[:20]!r} must be a whole number of tokens "
                f"from 1 to {self.max_positions}"
            )
        return _Param(name, int(raw), node.line)

    def union(self, node: _Node, path, scope: dict) -> _Union:
        _check_attrs(node, ("scaffold",))
        for t in node.texts():
            if t.text.strip():
                raise PMLError(
                    f"{node.describe()}: text {t.text.strip()[:30]!r} at line {t.line}; "
                    "a union holds only modules"
                )
        members = []
        for c in node.children():
            if c.tag != "module":
                raise PMLError(f"{c.describe()}: a <union> holds only <module> elements")
            members.append(self.module(c, path, scope))
        if not members:
            raise PMLError(f"{node.describe()}: a union needs at least one <module>")
        scaffold = node.attrs.get("scaffold")
        if scaffold is not None and scaffold not in [m.name for m in members]:
            raise PMLError(f"{node.describe()}: scaffold={scaffold[:40]!r} is not one of its members")
        return _Union(members, scaffold, node.line)


def _merge_text(items: list) -> list:
    out: list = []
    for it in items:
        if isinstance(it, str) and out and isinstance(out[-1], str):
            out[-1] += it
        elif not (isinstance(it, str) and it == ""):
            out.append(it)
    return out


def _trim_edges(items: list) -> list:
    items = list(items)
    if items and isinstance(items[0], str):
        items[0] = items[0].lstrip()
    if items and isinstance(items[-1], str):
        items[-1] = items[-1].rstrip()
    return [it for it in items if it != ""]


class _Layout:
    """Places a schema's pieces at token positions (needs the tokenizer for text lengths)."""

    def __init__(self, st: SegmentTokenizer, max_positions: int):
        self.st = st
        self.max_positions = max_positions
        self.pieces: list[Piece] = []
        self.modules: dict[tuple[str, ...], ModuleInfo] = {}
        self.unions: list[UnionInfo] = []

    def place(self, mod: _Module, pos: int, union: int | None = None) -> int:
        start = pos
        order = len(self.modules)
        if mod.path:
            self.modules[mod.path] = None  # reserve pre-order slot; filled below
        for it in mod.body:
            if isinstance(it, str):
                n = len(self.st.ids(it))
                if n > self.max_positions:
                    where = f'<module name="{mod.name}"> at line {mod.line}' if mod.path else "<schema> text"
                    raise PMLError(
                        f"{where}: a run of {n} tokens cannot fit in max_positions={self.max_positions}; "
                        "split it into smaller modules"
                    )
                if n:
                    self.pieces.append(Piece("text", mod.path, pos, n, text=it, line=mod.line))
                pos += n
            elif isinstance(it, _Param):
                self.pieces.append(Piece("param", mod.path, pos, it.length, name=it.name, line=it.line))
                pos += it.length
            elif isinstance(it, _Module):
                pos = self.place(it, pos)
            else:
                idx = len(self.unions)
                self.unions.append(UnionInfo(tuple(m.path for m in it.members), it.scaffold, it.line))
                pos = max(self.place(m, pos, union=idx) for m in it.members)
        if mod.path:
            params = tuple(p.name for p in mod.body if isinstance(p, _Param))
            self.modules[mod.path] = ModuleInfo(mod.path, mod.line, order, start, pos, params, union)
        return pos


# ---------------------------------------------------------------- prompts


@dataclass
class _Import:
    path: tuple[str, ...]
    args: dict[str, str]
    node: _Node
    top: bool


@dataclass
class _Fresh:
    text: str


class SchemaRegistry:
    """Registered PML schemas, and the resolution of PML prompts against them into Text / Chunk lists."""

    def __init__(
        self,
        segment_tokenizer: SegmentTokenizer,
        max_positions: int,
        *,
        schema_budget: int | None = None,
        layout: str = "auto",
        max_schema_chars: int = 16_000_000,
        max_prompt_chars: int = 1_000_000,
    ):
        if layout not in ("auto", "schema", "compact"):
            raise PMLError(f"layout={layout!r}; choose 'auto', 'schema' or 'compact'")
        if int(max_positions) < 2:
            raise PMLError(f"max_positions={max_positions}; it is the model's context length in tokens")
        self.st = segment_tokenizer
        self.max_positions = int(max_positions)
        self.schema_budget = self.max_positions // 2 if schema_budget is None else int(schema_budget)
        self.layout = layout
        self.max_schema_chars = max_schema_chars
        self.max_prompt_chars = max_prompt_chars
        self.schemas: dict[str, Schema] = {}
        self._roles: ChatRoles | None | bool = False  # False: not derived yet
        self._base = 0 if segment_tokenizer.bos_id is None else 1  # position 0 is the BOS sink

    def roles(self) -> ChatRoles | None:
        if self._roles is False:
            self._roles = chat_roles(self.st.tokenizer)
        return self._roles

    # -- schemas
    def add(self, pml: str) -> Schema:
        """Register a schema; returns it laid out at schema positions. Re-adding the same text is a no-op."""
        root = parse_pml(pml, max_chars=self.max_schema_chars, what="schema")
        reader = _SchemaReader(_RoleFn(self), self.max_positions)
        name, top = reader.read(root)
        if name in self.schemas:
            if self.schemas[name].source == pml:
                return self.schemas[name]
            raise PMLError(f"{root.describe()}: a different schema named {name!r} is already registered")
        layout = _Layout(self.st, self.max_positions)
        length = layout.place(top, self._base)
        schema = Schema(name, pml, length, tuple(layout.pieces), layout.modules, tuple(layout.unions),
                        tuple(reader.scaffolds))
        self.schemas[name] = schema
        return schema

    # -- prompts
    def segments(self, pml_prompt: str) -> list[Text | Chunk]:
        """Resolve a PML prompt against its registered schema into segments with explicit positions."""
        root = parse_pml(pml_prompt, max_chars=self.max_prompt_chars, what="prompt")
        if root.tag != "prompt":
            raise PMLError(f"a prompt's root element must be <prompt schema=...>, found {root.describe()}")
        _check_attrs(root, ("schema",))
        name = root.attrs.get("schema")
        if name is None:
            raise PMLError(f'{root.describe()} needs schema="..." naming a registered schema')
        schema = self.schemas.get(name)
        if schema is None:
            known = ", ".join(sorted(self.schemas)[:10]) or "none"
            raise PMLError(f"{root.describe()}: unknown schema {name[:40]!r} (registered: {known})")
        events = self._read_prompt(root, schema)
        return self._place(schema, events, root)

    def _read_prompt(self, root: _Node, schema: Schema) -> list[_Import | _Fresh]:
        events: list[_Import | _Fresh] = []
        # A final <assistant> (nothing but whitespace after it) stays open: the model writes the reply.
        last_node = next((c for c in reversed(root.content) if isinstance(c, _Node)), None)
        after = (
            root.content[max(i for i, c in enumerate(root.content) if c is last_node) + 1 :]
            if last_node
            else []
        )
        last_is_open = last_node is not None and not any(c.text.strip() for c in after)
        for c in root.content:
            if isinstance(c, _TextRun):
                if not _is_layout(c.text):
                    events.append(_Fresh(c.text))
            elif c.tag in ROLE_TAGS:
                events.append(_Fresh(self._role_text(c, open_turn=c is last_node and last_is_open)))
            elif c.tag in _STRUCTURE_TAGS:
                raise PMLError(
                    f"{c.describe()}: a <{c.tag}> cannot appear inside a <prompt>; import modules as <name/>"
                )
            else:
                self._read_import(c, (), schema, events, top=True)
        self._check_imports(schema, [e for e in events if isinstance(e, _Import)])
        return events

    def _role_text(self, node: _Node, open_turn: bool) -> str:
        _check_attrs(node, ())
        if node.children():
            raise PMLError(
                f"{node.children()[0].describe()}: a prompt's role tag holds only text; "
                f"put imports outside it (the schema's own role tags wrap cached modules)"
            )
        roles = self.roles()
        if roles is None:
            raise PMLError(f"{node.describe()}: role tags need a tokenizer with a chat template")
        prefix, suffix = roles.wrap(node.tag, node.describe())
        content = "".join(t.text for t in node.content if isinstance(t, _TextRun))
        if roles.trims:
            content = content.strip()
        if node.tag == "assistant" and open_turn:
            suffix = ""  # the model continues this turn
        return prefix + content + suffix

    def _read_import(self, node: _Node, parent: tuple, schema: Schema, events: list, top: bool) -> None:
        path = (*parent, node.tag)
        info = schema.modules.get(path)
        if info is None:
            inside = f" inside module {'/'.join(parent)}" if parent else ""
            names = sorted(p[-1] for p in schema.modules if p[:-1] == parent)
            shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "") if names else "none"
            raise PMLError(
                f"<{node.tag[:40]}> at line {node.line}: schema {schema.name!r} has no module "
                f"{node.tag[:40]!r}{inside} (available: {shown})"
            )
        for key in node.attrs:
            if key not in info.params:
                raise PMLError(
                    f"<{node.tag}> at line {node.line}: module {node.tag!r} has no parameter {key[:40]!r} "
                    f"(parameters: {', '.join(info.params) or 'none'})"
                )
        for p in info.params:
            if p not in node.attrs:
                raise PMLError(
                    f'<{node.tag}> at line {node.line}: missing argument {p}="..." for module {node.tag!r}'
                )
        for t in node.texts():
            raise PMLError(
                f"<{node.tag}> at line {node.line}: text {t.text.strip()[:30]!r} inside an import; "
                f"put free text outside the import element"
            )
        events.append(_Import(path, dict(node.attrs), node, top))
        for c in node.children():
            if c.tag in ROLE_TAGS or c.tag in _STRUCTURE_TAGS:
                raise PMLError(f"{c.describe()}: <{c.tag}> cannot appear inside the import <{node.tag}>")
            self._read_import(c, path, schema, events, top=False)

    def _check_imports(self, schema: Schema, imports: list[_Import]) -> None:
        seen: dict[tuple, _Import] = {}
        union_pick: dict[int, _Import] = {}
        prev: _Import | None = None
        for imp in imports:
            info = schema.modules[imp.path]
            if imp.path in seen:
                raise PMLError(
                    f"<{imp.node.tag}> at line {imp.node.line}: module imported twice "
                    f"(also at line {seen[imp.path].node.line})"
                )
            seen[imp.path] = imp
            if info.union is not None:
                other = union_pick.get(info.union)
                if other is not None:
                    raise PMLError(
                        f"<{imp.node.tag}> at line {imp.node.line}: "
                        f"{other.node.tag!r} (line {other.node.line}) "
                        f"is already imported from the same <union> (line {schema.unions[info.union].line}); "
                        f"import at most one member"
                    )
                union_pick[info.union] = imp
            if prev is not None and schema.modules[prev.path].order > info.order:
                raise PMLError(
                    f"<{imp.node.tag}> at line {imp.node.line} is imported after <{prev.node.tag}> "
                    f"(line {prev.node.line}) but the schema places it before; imports follow schema order"
                )
            prev = imp
        params = [p for p in schema.pieces if p.kind == "param"]
        for imp in imports:
            for p in params:
                if p.owner == imp.path:
                    n = len(self.st.ids(imp.args[p.name]))
                    if n > p.length:
                        raise PMLError(
                            f"<{imp.node.tag}> at line {imp.node.line}: argument {p.name}=... is {n} tokens; "
                            f"the parameter (schema line {p.line}) reserves length={p.length} tokens"
                        )

    def _place(self, schema: Schema, events: list, root: _Node) -> list[Text | Chunk]:
        order = _emission_order(schema, events)
        use_schema = self.layout == "schema" or (
            self.layout == "auto" and schema.length <= self.schema_budget
        )
        out = _positions(order, self.st, self._base, compact=False) if use_schema else None
        if out is None and self.layout == "schema":
            raise PMLError(
                f"{root.describe()}: the prompt's free text collides with the schema positions of a module "
                f"imported after it; move the text after the imports or use layout='compact'"
            )
        if out is None:
            out = _positions(order, self.st, self._base, compact=True)
        segs, end = out
        if end > self.max_positions:
            raise PMLError(
                f"{root.describe()}: the prompt needs {end} positions "
                f"but max_positions is {self.max_positions}; "
                f"import fewer modules or shorten the text"
            )
        if not any(self.st.ids(s.text) for s in segs):
            raise PMLError(f"{root.describe()}: the prompt has no tokens (nothing imported, no text)")
        if self._base == 1 and segs and segs[0].position != 1:
            # SegmentTokenizer.segments adds the BOS sink only when the first segment starts at 1 (or is
            # unplaced); a prompt whose first import sits later in the schema still needs the sink.
            segs.insert(0, Text("", position=1))
        return segs


class _RoleFn:
    """Role prefix/suffix lookup used while reading a schema (derives roles on first use)."""

    def __init__(self, registry: SchemaRegistry):
        self.registry = registry

    def __call__(self, role: str, where: str) -> tuple[str, str]:
        roles = self.registry.roles()
        if roles is None:
            raise PMLError(f"{where}: role tags need a tokenizer with a chat template")
        return roles.wrap(role, where)

    @property
    def trims(self) -> bool:
        roles = self.registry.roles()
        return bool(roles and roles.trims)


def _emission_order(schema: Schema, events: list) -> list[tuple[str, object]]:
    """Schema pieces the prompt uses, in schema order, with the prompt's fresh text slotted in.

    Returns ("piece", Piece, value) and ("fresh", text) entries. Fresh text written after an import (or at
    the start) comes after that import and the always-included text up to the next imported module.
    """
    imported = {e.path for e in events if isinstance(e, _Import)}
    args = {e.path: e.args for e in events if isinstance(e, _Import)}
    used = [p for p in schema.pieces if p.owner == () or p.owner in imported]
    out: list[tuple] = []
    i = 0

    def emit(p):
        out.append(("piece", p, args[p.owner][p.name] if p.kind == "param" else p.text))

    for ev in events:
        if isinstance(ev, _Import):
            if not ev.top:
                continue
            while i < len(used) and used[i].owner == ():
                emit(used[i])
                i += 1
            while i < len(used) and used[i].owner[:1] == ev.path:
                emit(used[i])
                i += 1
        else:
            while i < len(used) and used[i].owner == ():
                emit(used[i])
                i += 1
            out.append(("fresh", ev.text))
    for p in used[i:]:
        emit(p)
    return out


def _positions(order, st: SegmentTokenizer, base: int, compact: bool):
    """Give every entry a position; None when (schema layout) fresh text would overlap a later piece."""
    segs: list[Text | Chunk] = []
    cursor = base
    fresh_end = base  # end of the last fresh text: later pieces must start at or after it
    pending: list[str] = []

    def flush():
        nonlocal cursor, fresh_end
        text = "".join(pending)
        pending.clear()
        n = len(st.ids(text)) if text else 0
        if n:
            segs.append(Text(text, position=cursor))
            cursor += n
            fresh_end = cursor

    for entry in order:
        if entry[0] == "fresh":
            pending.append(entry[1])
            continue
        flush()
        _, p, value = entry
        pos = cursor if compact else p.start
        if pos < fresh_end:
            return None
        if p.kind == "text":
            segs.append(Chunk(value, position=pos, encode_position=p.start))
        elif value:
            segs.append(Text(value, position=pos))
        cursor = max(cursor, pos + p.length)
    flush()
    return segs, cursor


def equivalent_plain_prompt(segments: Sequence[Text | Chunk]) -> list[Text]:
    """The same prompt with every segment computed fresh at the same positions: what a `full` prefill sees.

    Token ids and position ids match `segments` exactly (see tests); only the caching differs. This is the
    reference the engine's outputs for a PML prompt are compared against.
    """
    return [Text(s.text, position=s.position) for s in segments]


# ---------------------------------------------------------------- helpers for plain chunk lists


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
