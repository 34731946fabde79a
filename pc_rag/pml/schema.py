"""PML schemas: reading a schema's element tree, and laying its pieces out at schema positions."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import PMLError
from ..segments import Chunk, SegmentTokenizer
from .parse import ROLE_TAGS, _check_attrs, _check_name, _is_layout, _Node, _TextRun


@dataclass(frozen=True)
class SchemaPiece:
    """One laid-out part of a schema: a run of cached text, or a parameter's reserved positions. (Not the plan's
    `pc_rag.plan.Piece`, which says where a prompt slot's KV comes from.)"""

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
    pieces: tuple[SchemaPiece, ...]
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
        self.pieces: list[SchemaPiece] = []
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
                    self.pieces.append(SchemaPiece("text", mod.path, pos, n, text=it, line=mod.line))
                pos += n
            elif isinstance(it, _Param):
                self.pieces.append(SchemaPiece("param", mod.path, pos, it.length, name=it.name, line=it.line))
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
