"""Tool calling: tools in the prompt, the model's calls parsed out of its reply, and calls forced by a grammar.

    tools (OpenAI function dicts, as LangChain's `convert_to_openai_tool` writes them)
    -> `render_chat(tokenizer, messages, tools)`: through the model's chat template (`apply_chat_template(tools=)`)
       when the template takes tools; otherwise the documented fallback below
    -> the engine decodes; with `tool_choice` "required" or a tool's name, `call_grammar` constrains the reply to
       one valid call in the model's own format, so the call always parses and its arguments match the schema
    -> `parse_reply(text, fmt, tools)`: the text before the calls, and the calls (`ToolCall`); output that does
       not parse as a call of a known tool is text, never an exception.

Formats (`ToolFormat.detect` reads the chat template; vLLM's parsers by the same names):
    hermes       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: Qwen2.5/Qwen3, Hermes, and the
                 fallback for a template that takes no tools (our tiny test model's)
    llama3_json  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`: Llama 3.1+
    mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`

The fallback rendering, for a template that never reads `tools`: the tools' JSON schemas and the Hermes call
format are described at the end of the system message (one is added first when there is none); an assistant
message's calls are written after its text in the Hermes format, and a tool result is a user message holding
`<tool_response>...</tool_response>`. A call is written back with the same separators the grammar makes the
model write (`json.dumps`'s), so a forced call re-rendered in the next step is the reply's own text, and the
engine gives it back its generated tokens: the next agent step reuses the previous step's prompt and reply.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import OptionError, OptionTypeError
from .grammar import Grammar, json_in_lark
from .segments import check_texts

FORMATS = ("hermes", "llama3_json", "mistral")
TOOL_CHOICES = ("auto", "none", "required", "any")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name, its arguments (a dict) and an id for the result to answer."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `tool_calls` entries write it (arguments as JSON text)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class CutCall:
    """A call the token budget ended before it was complete: the tool's name and the arguments' JSON text, as far as
    the model wrote them (either may be empty or cut short). OpenAI answers such a reply with `finish_reason:
    "length"` and the partial call in `tool_calls`; LangChain keeps it in `invalid_tool_calls`."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_spec(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as an OpenAI function dict `{"type": "function", "function": {name, description, parameters}}`;
    takes that dict or its bare `function` part."""
    if not isinstance(tool, Mapping):
        raise OptionTypeError(f"a tool must be a dict (an OpenAI function schema), got {type(tool).__name__}; "
                              "LangChain tools: langchain_core.utils.function_calling.convert_to_openai_tool")
    function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise OptionError(f"a tool needs a function with a name, got {json.dumps(tool, default=str)[:200]}")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    spec = {"name": function["name"], "description": function.get("description") or "", "parameters": parameters}
    return {"type": "function", "function": spec}


def tool_specs(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    specs = [tool_spec(t) for t in tools or ()]
    check_texts(specs, "tools")  # names, descriptions and schemas go into the prompt through the chat template
    names = [s["function"]["name"] for s in specs]
    if len(set(names)) != len(names):
        raise OptionError(f"tool names must be unique, got {names}")
    return specs


def check_tool_choice(tool_choice, specs: Sequence[Mapping[str, Any]]) -> str | None:
    """`tool_choice` as "auto", "none", "required" or a tool's name (OpenAI's `{"type": "function", "function":
    {"name": ...}}` and LangChain's "any" are read as those)."""
    if tool_choice is None or tool_choice is True:
        return "required" if tool_choice is True else "auto"
    if isinstance(tool_choice, Mapping):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if not isinstance(tool_choice, str):
        raise OptionTypeError(f"tool_choice must be auto, none, required or a tool's name, got {tool_choice!r}")
    if tool_choice == "any":
        return "required"
    names = [s["function"]["name"] for s in specs]
    if tool_choice not in TOOL_CHOICES and tool_choice not in names:
        raise OptionError(f"tool_choice {tool_choice!r} is not auto, none, required or one of the tools {names}")
    if tool_choice != "none" and tool_choice != "auto" and not names:
        raise OptionError(f"tool_choice {tool_choice!r} needs tools")
    return tool_choice


# ---- formats ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    name: str  # one of FORMATS
    native: bool  # the chat template renders tools itself (False: the fallback rendering in this module)

    @classmethod
    def detect(cls, tokenizer) -> ToolFormat:
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):  # several named templates: the one that takes tools, else the default
            template = template.get("tool_use") or template.get("default") or ""
        native = "tools" in template
        if "[TOOL_CALLS]" in template:
            return cls("mistral", native)
        if "<tool_call>" in template:
            return cls("hermes", native)
        if native and ("<|python_tag|>" in template or "ipython" in template):
            return cls("llama3_json", native)
        return cls("hermes", native)

    def call_text(self, calls: Sequence[ToolCall]) -> str:
        """How the model writes these calls (what a forced call's reply holds)."""
        if self.name == "mistral":
            return "[TOOL_CALLS]" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls],
                                               ensure_ascii=False)
        if self.name == "llama3_json":
            return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False)
                             for c in calls)
        return "\n".join("<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments},
                                                      ensure_ascii=False) + "\n</tool_call>" for c in calls)


def call_grammar(fmt: ToolFormat, specs: Sequence[Mapping[str, Any]], tool_choice: str | None,
                 parallel: bool = False) -> Grammar | None:
    """The grammar of a forced reply: one call (`parallel`: one or more) of any tool ("required") or of the named
    tool, written as `fmt` writes calls; None when the model chooses ("auto", "none")."""
    if tool_choice in (None, "auto", "none"):
        return None
    chosen = [s["function"] for s in specs if tool_choice == "required" or s["function"]["name"] == tool_choice]
    key = "parameters" if fmt.name == "llama3_json" else "arguments"
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                      "required": ["name", key], "additionalProperties": False} for f in chosen]}
    if len(chosen) == 1:
        one = one["anyOf"][0]
    if fmt.name == "llama3_json" and not parallel:
        return Grammar.json_schema(one)
    if fmt.name == "mistral":
        body = {"type": "array", "items": one, "minItems": 1} | ({} if parallel else {"maxItems": 1})
        return Grammar.json_schema(body)  # the [TOOL_CALLS] token is a special token: left to the parser
    if fmt.name == "llama3_json":  # parallel: calls separated by "; "
        call, sep = "args", "; "
    else:
        call, sep = r'"<tool_call>\n" args "\n</tool_call>"', "\n"
    start = f"start: call ({json.dumps(sep)} call)*" if parallel else "start: call"
    return Grammar.lark(f"{start}\ncall: {call}\nargs: {json_in_lark(one)}")


# ---- parsing ------------------------------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_reply(text: str, fmt: ToolFormat, specs: Sequence[Mapping[str, Any]] = (),
                tokenizer=None) -> tuple[str, list[ToolCall]]:
    """The reply's text (calls removed) and its calls. A call names one of `specs`' tools (any name when `specs` is
    empty) and has a JSON object for arguments; anything else stays text. Every format is tried, the template's
    first, so a model that writes another family's format is still understood."""
    names = {s["function"]["name"] for s in specs}
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        parsed = _parse_with_tokenizer(tokenizer, text, names)
        if parsed is not None:
            return parsed
    order = [fmt.name] + [f for f in FORMATS if f != fmt.name]
    for name in order:
        found = _PARSERS[name](text, names)
        if found is not None:
            return found
    return text, []


def parse_cut(text: str, fmt: ToolFormat, specs: Sequence[Mapping[str, Any]] = (),
              forced: bool = False) -> tuple[str, list[ToolCall | CutCall]] | None:
    """A reply the token budget ended inside its calls: the text before them, the calls complete before the cut, and
    the one it cut (`CutCall`); None when no call was begun (`forced`: the whole reply is calls, as a forced
    tool_choice's grammar makes it). Each call is a JSON object in every format, so the objects are read one after
    the other, whatever markers are between them."""
    names = {s["function"]["name"] for s in specs}
    starts = [at for at in (text.find(m) for m in _MARKERS) if at >= 0]
    if fmt.name == "llama3_json" and text.lstrip().startswith("{"):
        starts.append(len(text) - len(text.lstrip()))
    if not starts and not forced:
        return None
    start = 0 if forced else min(starts)
    head, body = text[:start].rstrip(), text[start:]
    calls: list[ToolCall | CutCall] = []
    decoder = json.JSONDecoder()
    pos = 0
    while (at := body.find("{", pos)) >= 0:
        try:
            obj, pos = decoder.raw_decode(body, at)
        except ValueError:
            calls.append(_cut_call(body[at:]))
            return head, calls
        call = _call(obj, names)
        calls.append(call if call is not None else _cut_call(body[at:pos]))
    if not calls:  # cut before the first object began (inside an opening marker)
        calls.append(CutCall("", ""))
    return head, calls


_CUT_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)')
_CUT_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _cut_call(text: str) -> CutCall:
    """A call's object as far as it was written: the name (cut short if the cut fell inside it) and the arguments'
    text from their start."""
    name = _CUT_NAME.search(text)
    arguments = _CUT_ARGUMENTS.search(text)
    return CutCall(_unescaped(name.group(1)) if name else "", text[arguments.end():].rstrip() if arguments else "")


def _unescaped(partial: str) -> str:
    try:
        return json.loads(f'"{partial}"')
    except ValueError:  # cut inside an escape
        return partial


def _call(obj, names, key=None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key) if key else obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict) or (names and obj["name"] not in names):
        return None
    return ToolCall(obj["name"], args)


def _loads(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _parse_hermes(text, names):
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls = [_call(_loads(m.group(1)), names) for m in _HERMES.finditer(text, start)]
    if not calls or any(c is None for c in calls):
        return None
    return text[:start].rstrip(), calls


def _parse_llama3(text, names):
    body = text.strip()
    prefix = ""
    tag = body.find("<|python_tag|>")
    if tag >= 0:
        prefix, body = body[:tag].rstrip(), body[tag + len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = _call(obj, names)
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " ;\n\t":
            pos += 1
    return (prefix, calls) if calls else None


def _parse_mistral(text, names):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    body = _loads(text[start + len("[TOOL_CALLS]"):].strip())
    if isinstance(body, dict):
        body = [body]
    if not isinstance(body, list) or not body:
        return None
    calls = [_call(o, names) for o in body]
    if any(c is None for c in calls):
        return None
    return text[:start].rstrip(), calls


_PARSERS = {"hermes": _parse_hermes, "llama3_json": _parse_llama3, "mistral": _parse_mistral}


def _parse_with_tokenizer(tokenizer, text, names):
    """transformers >= 5.13: a checkpoint that ships a response schema parses its own replies."""
    try:
        parsed = tokenizer.parse_response(text)
    except Exception:  # a reply the schema does not cover is the formats' to try
        return None
    raw = parsed.get("tool_calls") if isinstance(parsed, dict) else None
    if not raw:
        return None
    calls = [_call(c.get("function", c), names) for c in raw if isinstance(c, dict)]
    if not calls or any(c is None for c in calls):
        return None
    return parsed.get("content") or "", calls


# ---- rendering ----------------------------------------------------------------------------------------------------
def fallback_system_text(specs: Sequence[Mapping[str, Any]]) -> str:
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    return ("You may call one or more functions to assist with the user query. The functions, as JSON schemas:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call a function, reply with a JSON object naming it and giving its arguments, within tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render_messages(messages: Sequence[Mapping[str, Any]], specs: Sequence[Mapping[str, Any]],
                    fmt: ToolFormat) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and keyword arguments `apply_chat_template` is called with. Messages may carry OpenAI's
    `tool_calls` (arguments as a dict or JSON text) and `role: "tool"` results."""
    out: list[dict[str, Any]] = []
    if fmt.native:
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
            m.setdefault("content", "")
            if m["content"] is None:
                m["content"] = ""
            out.append(m)
        return out, ({"tools": list(specs)} if specs else {})
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if m.get("tool_calls"):
            calls = [ToolCall(**{k: v for k, v in _template_call(c)["function"].items() if k != "id"})
                     for c in m["tool_calls"]]
            text = fmt.call_text(calls)
            content = f"{content}\n{text}" if content.strip() else text
            out.append({"role": role, "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
        if m.get("reasoning_content"):  # an assistant's thinking: for templates that write it back (Qwen3's)
            out[-1]["reasoning_content"] = m["reasoning_content"]
    if specs:
        described = fallback_system_text(specs)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, {}


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI or LangChain tool call as chat templates take it: `{"type": "function", "function": {"name",
    "arguments": dict}}` (templates write the arguments with `tojson`)."""
    function = call.get("function", call)
    args = function.get("arguments", function.get("args", {}))
    if isinstance(args, str):
        args = _loads(args) or {}
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": args}}


# ---- streaming ----------------------------------------------------------------------------------------------------
_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


class CallFilter:
    """A reply's text pieces as a client sees them while it streams: text goes out as it comes, what may be the start
    of a call is held back until the reply ends (`finish` then parses the whole reply). With `forced` (the grammar
    makes the whole reply a call) nothing is streamed as text."""

    def __init__(self, fmt: ToolFormat, specs: Sequence[Mapping[str, Any]], forced: bool = False, tokenizer=None):
        self.fmt, self.specs, self.forced, self.tokenizer = fmt, specs, forced, tokenizer
        self.text = ""  # the whole reply so far
        self.sent = 0  # how much of it went out as text

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.forced:
            return ""
        hold = len(self.text)
        for marker in _MARKERS:
            at = self.text.find(marker, self.sent)
            if at >= 0:
                hold = min(hold, at)
            else:  # the text may end with the marker's first characters
                for n in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
                    if self.text.endswith(marker[:n]):
                        hold = min(hold, len(self.text) - n)
                        break
        if self.fmt.name == "llama3_json" and self.text[: max(hold, 1)].lstrip().startswith("{"):
            hold = 0  # a Llama 3 call is the whole reply as one JSON object
        out = self.text[self.sent:hold] if hold > self.sent else ""
        self.sent = max(self.sent, hold)
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall | CutCall]]:
        """The text not yet sent, and the reply's calls. `cut`: the token budget ended the reply; a call it ended
        inside is a `CutCall`, and its markup never comes out as text."""
        content, calls = parse_reply(self.text, self.fmt, self.specs, self.tokenizer)
        if not calls and cut:
            found = parse_cut(self.text, self.fmt, self.specs, self.forced)
            if found is not None:
                content, calls = found
        if not calls:
            return self.text[self.sent:], []
        return content[self.sent:] if content.startswith(self.text[: self.sent]) else "", calls
