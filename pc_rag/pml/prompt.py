"""PML prompts: the schema registry, and resolving a prompt against its schema into placed segments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PMLError
from ..segments import Chunk, SegmentTokenizer, Text
from .parse import _STRUCTURE_TAGS, ROLE_TAGS, _check_attrs, _is_layout, _Node, _TextRun, parse_pml
from .roles import ChatRoles, chat_roles
from .schema import Schema, _Layout, _SchemaReader


@dataclass
class _Import:
    path: tuple[str, ...]
    args: dict[str, str]
    node: _Node
    top: bool


@dataclass
class _Fresh:
    text: str


@dataclass(frozen=True)
class PML:
    """A prompt written in PML, resolved against the engine's registered schemas: `Engine.generate(PML(...))`.

    PML is asked for explicitly: a plain string is always plain text, even one that begins with "<prompt"
    (a user may well ask about an HTML-like tag), so no prompt changes meaning by its first characters.
    """

    text: str

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise PMLError(f"PML(...) takes the prompt as a str, got {type(self.text).__name__}")


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

    Returns ("piece", SchemaPiece, value) and ("fresh", text) entries. Fresh text written after an import (or at
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
