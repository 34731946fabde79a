"""Constrained decoding: a grammar narrows every decode step to the tokens that keep the output valid.

    Grammar (a value: a JSON schema, any JSON object, a regex, a choice of strings, a structural tag)
    -> `Grammars.state(grammar)`: compiled once per grammar for the engine's tokenizer (xgrammar, LRU-bounded),
       then a fresh matcher for the request
    -> the request's `decode.Sampler` holds that `GrammarState`: at each step it masks the logits row (-inf for
       every token the grammar forbids; EOS only once the output is complete), chooses, and accepts the token.

The sampler is the one place both decode paths choose a token (a lone request's own loop, and each row of the
batched loop, batch.py), so a batch mixes rows with and without grammars with nothing else to change; the mask
is applied to a CPU copy of the row, which leaves the batch's logits as they were.

xgrammar (vLLM's and SGLang's default backend) is the optional `structured` extra: it is imported on the first
grammar, and an engine used without grammars never loads it. Measured cost on the 2-core CPU: `benchmarks/
structured.py` (docs/agents.md).

JSON is compact by default (`json.dumps`'s separators, no free whitespace): a model that may put any whitespace
between tokens can also loop on it forever, which a random test model does. In a structural tag too: xgrammar's
`json_schema` element there allows at least one free whitespace, so one with `"max_whitespace_cnt": 0` is
compiled as the EBNF of the compact schema.

A workaround, for xgrammar 0.2.9: a JSON string with `maxLength` (or a pattern) compiles to a character class that
lets raw control characters through (`[^"\\\r\n]`; xgrammar issue #286), which `json.loads` then refuses (23 of 100
random-model outputs here). JSON never holds a raw control character other than the newlines a format writes
between calls, so for JSON and tool-call grammars the tokens holding one (U+0000-U+001F but \n and \r) are masked too.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import OptionError, OptionTypeError

KINDS = ("json_schema", "json_object", "regex", "choice", "structural_tag")

# Compiled grammars kept per engine. A JSON schema compiles in about 10 ms for a small schema on this CPU and up
# to seconds for large nested ones; an agent sends the same few schemas (its tools, its output type) every step.
MAX_COMPILED = 64

INSTALL_HINT = 'constrained decoding needs xgrammar: pip install "pc-rag[structured]"'


@dataclass(frozen=True)
class Grammar:
    """What a reply must match. Build one with the class methods; equal grammars share one compilation."""

    kind: str  # one of KINDS
    source: str  # the schema or structural tag as JSON text, the regex, or the choices as a JSON list

    def __post_init__(self):
        if self.kind not in KINDS:
            raise OptionError(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise OptionTypeError(f"a grammar's source must be a str, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | type) -> Grammar:
        """A JSON value valid against `schema`: a dict, its JSON text, or a pydantic model class. Properties come
        out in the schema's order, with `json.dumps`'s separators."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise OptionError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise OptionTypeError(f"a JSON schema must be a dict, JSON text or pydantic model, got "
                                  f"{type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))  # key order kept: it is property order

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching `pattern` in full (xgrammar's regex: ECMAScript syntax, no lookaround or backreference)."""
        if not isinstance(pattern, str) or not pattern:
            raise OptionError(f"a regex grammar needs a non-empty pattern, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Iterable[str]) -> Grammar:
        """Exactly one of `options`."""
        if isinstance(options, str):
            raise OptionTypeError("choice takes a list of strings, not one string")
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise OptionError(f"choice needs a non-empty list of non-empty strings, got {options!r}")
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @classmethod
    def structural_tag(cls, tag: Mapping[str, Any]) -> Grammar:
        """xgrammar's structural tag (`{"type": "structural_tag", "format": {...}}`): literal text around JSON
        schemas, how forced tool calls are written in a model's own format (pc_rag.tools)."""
        return cls("structural_tag", json.dumps(dict(tag), ensure_ascii=False))


class GrammarState:
    """One request's place in its grammar: a matcher and its token bitmask. Used by one thread at a time (the
    request's, or the decode loop's while the request is a row)."""

    def __init__(self, compiled, vocab_size: int, eos_id: int | None, never: torch.Tensor | None = None):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.never = never  # [vocab] bool: tokens masked at every step besides the grammar's (module docstring)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] as a CPU float32 copy with every token the grammar forbids at -inf."""
        out = logits.detach().to("cpu", torch.float32, copy=True)
        if self.matcher.is_terminated():  # the output is complete and its stop token taken: nothing may follow
            out.fill_(float("-inf"))
        else:
            self.matcher.fill_next_token_bitmask(self.bitmask)
            self._xgr.apply_token_bitmask_inplace(out[None, : self.vocab_size], self.bitmask)
            if self.never is not None:
                out[: self.vocab_size].masked_fill_(self.never, float("-inf"))
        if out.isneginf().all() and self.eos_id is not None:  # nothing allowed (a dead end): end the reply
            out[self.eos_id] = 0.0
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole match (the grammar may end here)."""
        return self.matcher.is_terminated() or self.matcher.is_completed()


class Grammars:
    """An engine's compiled grammars for its tokenizer (LRU, at most `max_compiled`), and the states built on
    them. Thread-safe; compiling happens outside the lock, so one slow schema does not hold up the others (two
    threads asking for the same new grammar may both compile it once)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int], max_compiled: int = MAX_COMPILED):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.max_compiled = max_compiled
        self._compiler = None
        self._control_tokens: torch.Tensor | None = None  # [vocab] bool, tokens holding a raw control character
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (a cache miss each)

    def _compiler_now(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise OptionError(INSTALL_HINT) from None
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids or None)
                # Our own LRU below is the cache: xgrammar's would hold every schema ever seen.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
                control = bytes(c for c in range(32) if c not in b"\r\n")
                held = [i for i, token in enumerate(info.decoded_vocab[: self.vocab_size])
                        if i not in self.stop_ids and any(c in control for c in token)]
                self._control_tokens = torch.zeros(self.vocab_size, dtype=torch.bool)
                self._control_tokens[held] = True
            return self._compiler

    def compiled(self, grammar: Grammar):
        """`grammar` compiled for this tokenizer (from the cache when it was compiled before)."""
        if not isinstance(grammar, Grammar):
            raise OptionTypeError(f"grammar must be a pc_rag.Grammar, got {type(grammar).__name__}")
        with self._lock:
            found = self._compiled.get(grammar)
            if found is not None:
                self._compiled.move_to_end(grammar)
                return found
        compiled = self._compile(self._compiler_now(), grammar)
        with self._lock:
            self.compiles += 1
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.max_compiled:
                self._compiled.popitem(last=False)
        return compiled

    def state(self, grammar: Grammar) -> GrammarState:
        """A fresh matcher at the start of `grammar`, for one request."""
        compiled = self.compiled(grammar)
        never = self._control_tokens if grammar.kind in ("json_schema", "json_object", "structural_tag") else None
        return GrammarState(compiled, self.vocab_size, self.stop_ids[0] if self.stop_ids else None, never)

    def __len__(self) -> int:
        return len(self._compiled)

    @staticmethod
    def _compile(compiler, grammar: Grammar):
        try:
            if grammar.kind == "json_schema":
                return compiler.compile_json_schema(grammar.source, any_whitespace=False)
            if grammar.kind == "json_object":
                # Not the builtin JSON grammar: it admits any JSON value (an array, a number) with free whitespace.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if grammar.kind == "regex":
                return compiler.compile_regex(grammar.source)
            if grammar.kind == "choice":
                # EBNF string literals take JSON's escapes, so each choice is its JSON text.
                options = json.loads(grammar.source)
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
            return compiler.compile_structural_tag(json.dumps(_compact_json(json.loads(grammar.source))))
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors on a bad schema/regex/tag
            raise OptionError(f"the {grammar.kind} grammar does not compile: {e}") from None


def _compact_json(node):
    """A structural tag whose `json_schema` elements asking for `"max_whitespace_cnt": 0` are written as the EBNF of
    the compact JSON schema (xgrammar's element requires a positive count)."""
    if isinstance(node, list):
        return [_compact_json(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("max_whitespace_cnt") == 0:
        import xgrammar as xgr

        ebnf = xgr.Grammar.from_json_schema(json.dumps(node["json_schema"]), any_whitespace=False)
        return {"type": "grammar", "grammar": str(ebnf)}
    return {k: _compact_json(v) for k, v in node.items()}
