"""Constrained decoding: a grammar narrows every decode step to the tokens that keep the output valid.

    Grammar (a value: a JSON schema, any JSON object, a regex, a choice of strings, a Lark grammar)
    -> `Grammars.state(grammar)`: compiled once per grammar for the engine's tokenizer (llguidance, LRU-bounded),
       then a fresh matcher for the request
    -> the request's `decode.Sampler` holds that `GrammarState`: at each step it masks the logits row (-inf for
       every token the grammar forbids; EOS only once the output is complete), chooses, and accepts the token.

The sampler is the one place both decode paths choose a token (a lone request's own loop, and each row of the
batched loop, batch.py), so a batch mixes rows with and without grammars with nothing else to change; the mask
is applied to a CPU copy of the row, which leaves the batch's logits as they were.

llguidance (llama.cpp's and vLLM's other backend: a 3 MB wheel with no dependencies) is a core dependency, so
`pip install pc-rag` alone gives structured output and forced tool calls; it is imported on the first grammar. It
replaced xgrammar, whose wheel pulls triton on Linux (about 1 GB installed, used only by its CUDA kernel):
`benchmarks/structured.py` measures both (install size, compile time, per-token mask time at 8K and 128K
vocabularies, batched rows; docs/agents.md has the table).

A compiled grammar is an llguidance matcher at the grammar's start; each request's matcher is a copy of it
(`deep_copy`: no second compilation).

JSON is compact by default (`json.dumps`'s separators, no free whitespace): a model that may put any whitespace
between tokens can also loop on it forever, which a random test model does. The same holds for the JSON inside a
Lark grammar (`json_in_lark`), which is how forced tool calls are written in a model's own format (pc_rag.tools).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import OptionError, OptionTypeError
from .segments import unicode_problem

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")

# Compiled grammars kept per engine. A small JSON schema compiles in about 1 ms on this CPU, large nested ones in up
# to a second; an agent sends the same few schemas (its tools, its output type) every step.
MAX_COMPILED = 64

INSTALL_HINT = ("constrained decoding needs llguidance, a dependency of pc-rag that is not importable here: "
                'pip install "llguidance>=1.9,<2"')

# JSON as `json.dumps` writes it, with no free whitespace (module docstring): llguidance's JSON options, given as a
# schema's "x-guidance" (which is how a schema inside a Lark grammar carries them).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a reply must match. Build one with the class methods; equal grammars share one compilation."""

    kind: str  # one of KINDS
    source: str  # the schema as JSON text, the regex, the choices as a JSON list, or the Lark grammar

    def __post_init__(self):
        if self.kind not in KINDS:
            raise OptionError(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise OptionTypeError(f"a grammar's source must be a str, got {type(self.source).__name__}")
        problem = unicode_problem(self.source)
        if problem is not None:  # llguidance's tokenizer works on UTF-8 bytes
            raise OptionError(f"the {self.kind} grammar holds {problem}, which is not valid Unicode text")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | type) -> Grammar:
        """A JSON value valid against `schema`: a dict, its JSON text, or a pydantic model class. Properties come
        out in the schema's order, with `json.dumps`'s separators."""
        return cls("json_schema", json.dumps(_schema_dict(schema), ensure_ascii=False))  # key order: property order

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching `pattern` in full (Rust's regex syntax, as llguidance reads it: no lookaround or
        backreference)."""
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
    def lark(cls, grammar: str) -> Grammar:
        """A grammar in llguidance's Lark syntax (its `start` rule is the whole reply): literal text around JSON
        schemas (`json_in_lark`) is how forced tool calls are written in a model's own format (pc_rag.tools)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise OptionError(f"a Lark grammar needs a non-empty text, got {grammar!r}")
        return cls("lark", grammar)


def json_in_lark(schema: Mapping[str, Any] | str | type) -> str:
    """`schema` as a Lark grammar's `%json` element, written compactly as `Grammar.json_schema` writes JSON."""
    return "%json " + json.dumps(_compact(_schema_dict(schema)), ensure_ascii=False)


def _schema_dict(schema) -> dict:
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
    return dict(schema)


def _compact(schema: dict) -> dict:
    """The schema, closed (`closed`), with the compact JSON options; the schema's own "x-guidance" options win."""
    schema = closed(schema)
    return {**schema, "x-guidance": {**COMPACT_JSON, **schema.get("x-guidance", {})}}


# Where a JSON schema holds schemas: keywords whose value is one, a list of them, or a map of names to them.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "contains",
        "propertyNames", "not", "if", "then", "else")
_MANY = ("anyOf", "allOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema):
    """`schema` with `"additionalProperties": false` in every object schema that lists its `properties` and says
    nothing of other properties. JSON Schema lets such an object hold any other key, which a model then fills with
    free text (a random model's never ends); OpenAI's strict schemas, xgrammar's default and LangChain's pydantic
    schemas all mean the listed properties only."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise OptionError(INSTALL_HINT) from None
    return llguidance


class GrammarState:
    """One request's place in its grammar: a matcher and its token bitmask. Used by one thread at a time (the
    request's, or the decode loop's while the request is a row).

    The grammar judges how the reply ended (`decode.Sampler.judged`): "stop" only where the grammar accepts the
    reply. Where it cannot go on (a dead end, or one of llguidance's limits reached while matching: the matcher's
    error state, which it never leaves) the mask allows the stop token alone, so that the reply ends at once, and
    `failure` says why; the request then finishes with "error", never "stop"."""

    _NEG_INF = torch.tensor(float("-inf"))

    def __init__(self, matcher, vocab_size: int, eos_id: int | None, start=None, ll_tokenizer=None,
                 on_failure: Callable[[], None] = lambda: None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # bit i of word j: token 32j + i allowed
        self.eos_id = eos_id
        self.start, self.ll_tokenizer = start, ll_tokenizer  # the compiled grammar and its tokenizer (`accepts`)
        self.failure: str | None = None  # why the grammar can no longer be completed
        self._on_failure = on_failure  # Grammars.forget: the compiled grammar may be spent (see there)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] as a CPU float32 copy with every token the grammar forbids at -inf."""
        row = logits.detach().to("cpu", torch.float32)
        # Once the output is complete (or its stop token taken) the mask allows the stop tokens only.
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        self._note_error()  # a limit reached while computing the mask
        # Unpacked by numpy (10 us at 128K tokens); torch's shifts of int32 took 50 ms there.
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little", count=self.vocab_size)
        out = torch.where(torch.from_numpy(bits).view(torch.bool), row[: self.vocab_size], self._NEG_INF)
        if row.numel() > self.vocab_size:  # logits past the grammar's vocabulary: never allowed
            out = torch.cat([out, row.new_full((row.numel() - self.vocab_size,), float("-inf"))])
        if not self.bitmask.any() and self.eos_id is not None:  # nothing allowed (a dead end): end the reply
            if self.failure is None and not self.complete:
                self.failure = DEAD_END
            out[self.eos_id] = 0.0
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
            self._note_error()

    def _note_error(self) -> None:
        if self.failure is None and self.matcher.is_error():
            self.failure = _error_text(self.matcher)
            self._on_failure()

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole match (the grammar may end here)."""
        return not self.matcher.is_error() and (self.matcher.is_stopped() or self.matcher.is_accepting())

    def accepts(self, text: str) -> bool:
        """Whether `text` is a whole match of the grammar: for a reply a stop string cut, whose text is not what
        the matcher consumed (it took the stop string's tokens too). Read by a fresh matcher, from the text's
        bytes as llguidance's own tokenizer cuts them (any tokens of the same bytes match alike)."""
        if self.start is None or self.ll_tokenizer is None:
            return False
        matcher = self.start.deep_copy()
        return (matcher.consume_tokens(self.ll_tokenizer.greedy_tokenize(text))
                and not matcher.is_error() and matcher.is_accepting())


class Grammars:
    """An engine's compiled grammars for its tokenizer (LRU, at most `max_compiled`), and the states built on
    them. Thread-safe; compiling happens outside the lock, so one slow schema does not hold up the others (two
    threads asking for the same new grammar may both compile it once)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int], max_compiled: int = MAX_COMPILED):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.max_compiled = max_compiled
        self._ll_tokenizer = None
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()
        # Grammars refused (their message), as many as kept compiled: a client resending a schema past llguidance's
        # limits costs a lookup, not the compile and the probe that found it (0.4 s for `a{1000000}`).
        self._refused: OrderedDict[Grammar, str] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (a cache miss each)

    def _tokenizer_now(self):
        """The tokenizer as llguidance reads it (its token trie: built once per engine, ~0.1 s at 8K tokens,
        ~2 s at 128K on this CPU)."""
        with self._lock:
            if self._ll_tokenizer is None:
                llguidance = _llguidance()
                backend = getattr(self.tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise OptionError(f"constrained decoding needs a fast (tokenizers-backed) tokenizer; "
                                      f"{type(self.tokenizer).__name__} has none")
                # Without the padding and truncation state a call may leave on the tokenizer.
                spec = json.loads(backend.to_str())
                spec["padding"] = spec["truncation"] = None
                self._ll_tokenizer = llguidance.LLTokenizer(json.dumps(spec), n_vocab=self.vocab_size,
                                                            eos_token=self.stop_ids or None)
            return self._ll_tokenizer

    def compiled(self, grammar: Grammar):
        """`grammar` compiled for this tokenizer (from the cache when it was compiled before): a matcher at its
        start, which requests copy."""
        if not isinstance(grammar, Grammar):
            raise OptionTypeError(f"grammar must be a pc_rag.Grammar, got {type(grammar).__name__}")
        with self._lock:
            found = self._compiled.get(grammar)
            if found is not None:
                self._compiled.move_to_end(grammar)
                return found
            refused = self._refused.get(grammar)
        if refused is not None:  # refused before: the same error, without the compile (up to a second) again
            raise OptionError(refused)
        tokenizer = self._tokenizer_now()  # outside: a missing llguidance is not the grammar's fault
        try:
            compiled = self._compile(tokenizer, grammar)
        except OptionError as e:
            with self._lock:
                self._refused[grammar] = str(e)
                while len(self._refused) > self.max_compiled:
                    self._refused.popitem(last=False)
            raise
        with self._lock:
            self.compiles += 1
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.max_compiled:
                self._compiled.popitem(last=False)
        return compiled

    def state(self, grammar: Grammar) -> GrammarState:
        """A fresh matcher at the start of `grammar`, for one request."""
        start = self.compiled(grammar)
        return GrammarState(start.deep_copy(), self.vocab_size, self.stop_ids[0] if self.stop_ids else None,
                            start, self._ll_tokenizer, lambda: self.forget(grammar, start))

    def forget(self, grammar: Grammar, compiled) -> None:
        """Drop `compiled` (if it is still `grammar`'s): a request's matcher failed on it. The copies of a compiled
        grammar share its lexer, which builds its automaton as the requests reach new lexemes, so one request that
        took it past llguidance's limits leaves every later copy failing at its first token (measured: a schema
        whose string branch is `a{1000000}`, reached once, failed every later request, its integer branch too).
        The next request compiles it afresh and fails only if it takes that branch itself."""
        with self._lock:
            if self._compiled.get(grammar) is compiled:
                del self._compiled[grammar]

    def __len__(self) -> int:
        return len(self._compiled)

    @staticmethod
    def _compile(tokenizer, grammar: Grammar):
        llguidance = _llguidance()
        matchers = llguidance.LLMatcher
        try:
            if grammar.kind == "json_schema":
                text = matchers.grammar_from_json_schema(closed(json.loads(grammar.source)), defaults=COMPACT_JSON)
            elif grammar.kind == "json_object":
                text = matchers.grammar_from_json_schema('{"type": "object"}', defaults=COMPACT_JSON)
            elif grammar.kind == "regex":
                text = matchers.grammar_from_regex(grammar.source)
            elif grammar.kind == "choice":
                # Lark string literals take JSON's escapes, so each choice is its JSON text.
                text = matchers.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in
                                                                         json.loads(grammar.source)))
            else:
                text = matchers.grammar_from_lark(grammar.source)
        except ValueError as e:  # a schema that is not a JSON object
            raise OptionError(f"the {grammar.kind} grammar does not compile: {e}") from None
        # verbose_errors=False: an error names what failed, not the parser's state (a client's schema, on a shared
        # server); llguidance's limits are its defaults otherwise.
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if matcher.is_error():  # llguidance reports a bad grammar as the matcher's state, never by raising
            raise OptionError(f"the {grammar.kind} grammar does not compile: {matcher.get_error()}")
        _probe(matcher, grammar)
        return matcher


def _probe(matcher, grammar: Grammar) -> None:
    """Refuse (OptionError) a grammar that fails along the text it forces from its start: llguidance builds a
    lexeme's automaton when the parse first reaches it, so a string `pattern` beyond its limits (`a{1000000}`, a
    nested repetition) or a rule no text completes is an error only there, after the reply's first tokens, where
    it would otherwise end a reply that claims to be complete. Found here it is a 400 before any work. What the
    probe cannot reach (a branch the model may or may not take) fails during decoding instead: the reply then
    finishes with "error" (GrammarState)."""
    probe = matcher.deep_copy()
    probe.consume_tokens(probe.compute_ff_tokens())
    if not probe.is_error() and not any(probe.compute_bitmask()):
        raise OptionError(f"the {grammar.kind} grammar cannot be completed: {DEAD_END}")
    if probe.is_error():
        raise OptionError(f"the {grammar.kind} grammar cannot be completed: {_error_text(probe)}")


DEAD_END = "no token can continue the reply (a dead end: no text satisfies the grammar from here)"


def _error_text(matcher) -> str:
    """A matcher's error as a client reads it: its first line, llguidance's name for a dead end spelled out."""
    text = matcher.get_error().strip().splitlines()
    first = text[0] if text else "the grammar engine failed"
    return DEAD_END if first.startswith("NoExtensionBias") else first
