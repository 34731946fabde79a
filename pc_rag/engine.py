"""The engine: a prompt in, generated text out, with chunk KV reused across requests.

    prompt -> token segments (segments.py)
    -> plan: where each slot's KV comes from, from the store's answers (plan.py, prefix.py, lookups.py)
    -> encode the misses, build the cache, forward the fresh slots (assemble.py) -> first logits
    -> decode loop (decode.py, batch.py) -> Generation -> prefix blocks saved (assemble.save_prefix)

`Engine.explain` runs only the planning step, on answers that read nothing (`Store.where`).

Cache namespaces: every call that plans, stores or splits a prompt takes `cache_salt=` (None: no namespace, the
keys of earlier versions). A request reuses only what requests with the same salt stored, plus public chunks
(`register(texts, public=True)`, `Chunk(public=True)`); the reply index, the tokenizer's memo and automatic
scaffolds are kept per namespace too (blocks.py says how keys carry it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from .assemble import Assembled, Assembler, Recompute
from .batch import MAX_BATCH, BatchDecoder, RowTokens, TurnLock, decode_steps_needed
from .choices import Choice, run_choices
from .decode import Sampler, Sampling, TextStream, TokenLogprob, TokenTexts
from .errors import OptionError, PromptError
from .grammar import Grammar, Grammars
from .lookups import WhereLookups
from .model import LlamaRunner, release_team, releasing_team
from .options import DEFAULT_RECOMPUTE_RATIO, MODES, GenerationOptions, check_device, checked_cache_salt
from .passages import marker_pattern
from .plan import COMPUTED, REUSING_CHUNKS, Load, Plan, Planner
from .pml import PML, Schema, SchemaRegistry
from .prefetch import PREFETCHER, Prefetcher
from .reasoning import ThinkingMarkers
from .scaffolds import ScaffoldBuilder
from .segments import Chunk, Prompt, SegmentTokenizer, Text, TokenSegment
from .store import open_store
from .text_index import DISCOVERY, ChunkIndex, Discovery, ReplyIndex, marked, resolve, with_passages

log = logging.getLogger("pc_rag")


@dataclass(frozen=True)
class SegmentSource:
    """Where one piece of the prompt's KV came from, in prompt order."""

    kind: str  # "bos" | "text" | "sep" | "chunk" | "scaffold" (a declared group) | "prefix" (a prefix block)
    tokens: int
    source: str  # "fresh" | "prefix" | "chunk" | "scaffold"
    origin: str | None  # store tier that served it, "computed" when this request encoded it, None if fresh


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: tuple[int, ...]
    mode: str
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    prompt_tokens: int
    cached_tokens: int  # KV reused from the store (cached_tokens + computed_tokens == prompt_tokens)
    computed_tokens: int
    stored_tokens: int  # prompt tokens whose KV this request newly stored (chunks it encoded, prefix blocks)
    recomputed_tokens: int  # blend: reused chunk tokens recomputed in context (part of computed_tokens)
    ttft_s: float  # from the call to the first token chosen: tokenize, look up, load, relocate, forward
    total_s: float
    sources: tuple[SegmentSource, ...]
    prompt_ids: tuple[int, ...]  # the prompt's token ids, as the model saw them
    # The plan the request carried out: what `explain` showed just before, for a request without faults; what
    # changed while it ran (a block lost between lookup and read) is in `plan.events`.
    plan: Plan | None = field(default=None, repr=False, compare=False)
    # `logprobs=k`: each generated token's log-probability and the k most likely tokens of its step (decode.py:
    # TokenLogprob); None when not asked.
    logprobs: tuple[TokenLogprob, ...] | None = None
    inter_token_s: tuple[float, ...] = ()  # seconds between each generated token and the one before it
    # Every reply of the request, choices[0] being this one's text, token_ids, finish_reason and logprobs (n > 1
    # asks for more; the prompt's counts and times above are the request's, shared by its choices).
    choices: tuple[Choice, ...] = ()

    def __post_init__(self):
        if not self.choices:
            object.__setattr__(self, "choices", (Choice(0, self.text, self.token_ids, self.finish_reason,
                                                        self.logprobs, self.inter_token_s),))

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, over every choice."""
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / (self.total_s - self.ttft_s) if n > 0 and self.total_s > self.ttft_s else float("nan")


@dataclass(frozen=True)
class ExplainRow:
    """One piece of an explained prompt: what its slots hold and where their KV would come from."""

    kind: str  # what the slots hold: "bos" | "text" | "sep" | "chunk" | "scaffold" | "prefix"
    tokens: int
    slots: tuple[int, int]  # [first, end) in the request's cache
    positions: tuple[int, int]  # position ids of its first and last token
    source: str  # "fresh" | "prefix" | "chunk" | "scaffold" (as `SegmentSource.source`)
    load: str  # how its KV would be obtained: "compute" | "copy" | "read" | "encode" | "stored" (plan.py)
    tier: str | None  # the tier holding its block (None: fresh, or not stored yet)
    kv: str  # the two above in words ("memory hit", "disk hit, read into the buffer", ...)
    key: str | None  # the store key of its block
    text: str  # the start of its text


# How `explain` words each way a piece's KV is obtained (plan.py, `Piece.load`).
_LOADS = {Load.COMPUTE: "computed by the forward", Load.COPY: "{tier} hit",
          Load.READ: "{tier} hit, read into the buffer", Load.ENCODE: "miss: encoded and stored",
          Load.STORED: "encoded above in this prompt"}


@dataclass(frozen=True)
class Explanation:
    """What a request for this prompt would do, before it runs (`Engine.explain`): the plan, as rows."""

    mode: str
    plan: Plan
    rows: tuple[ExplainRow, ...]

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV would come from the store (before blend's recompute and the prompt's last token,
        which is always computed for its logits)."""
        return sum(r.tokens for r in self.rows if r.load in (Load.COPY, Load.READ, Load.STORED))

    @property
    def computed_tokens(self) -> int:
        return sum(r.tokens for r in self.rows if r.load == Load.COMPUTE)

    @property
    def encoded_tokens(self) -> int:
        return sum(r.tokens for r in self.rows if r.load == Load.ENCODE)

    def __str__(self) -> str:
        head = ("kind", "tokens", "slots", "positions", "kv from", "text")
        body = [(r.kind, str(r.tokens), f"{r.slots[0]}-{r.slots[1] - 1}", f"{r.positions[0]}-{r.positions[1]}",
                 r.kv, r.text) for r in self.rows]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
                 for row in [head, *body]]
        lines.append(f"{self.mode}: {len(self.plan.ids)} prompt tokens; {self.reused_tokens} from the store, "
                     f"{self.encoded_tokens} to encode, {self.computed_tokens} computed by the forward; "
                     f"{self.plan.stored_tokens} newly stored")
        return "\n".join(lines)


class Engine:
    """Generate with an HF decoder of a supported family (docs/models.md), reusing cached chunk KV.

    Modes: "full" (no reuse, the reference), "exact" (longest cached prefix: identical to full),
    "modular" (default: exact prefix where there is one, then every chunk from its own cached encoding,
    RoPE-relocated to its place; an approximation, since a chunk never saw what precedes it), and "blend"
    (modular, then a `recompute_ratio` fraction of the reused chunk tokens recomputed with the whole prompt
    as context, chosen by `blend_selection`).
    """

    # How blend picks the tokens it recomputes (assemble.Recompute). "progressive" (CacheBlend's layer-by-layer
    # narrowing) at the default ratio 0.2 is the setting that recovers 90% of modular's two-hop accuracy loss on
    # the trained retrieval model at 3 and 4 chunks (two seeds of 1,000 prompts, pooled; docs/results.md), where
    # "deviation" (one selection) recovers about half and "chunk_start" (EPIC, no probe) under half at that
    # ratio. It costs more than the ratio: its probe runs layer 0 over every chunk token and its first layers
    # keep more tokens (token-layers 0.55 of a full recompute at 4 layers, 0.24 at 32); "chunk_start" costs
    # exactly the ratio. The measured TTFT of each is in docs/results.md.
    blend_selection = "progressive"
    # Documents the framework hooks discover are prefetched from disk/Redis into memory (pc_rag.prefetch).
    prefetch_on_discover = True

    # Requests that decode at the same time share one forward pass per step (batch.py: continuous batching;
    # greedy tokens equal one-at-a-time runs, tests/test_batch.py). False: each request runs its own decode
    # loop, concurrent requests taking turns at every step (the engine before batching; the benchmark's
    # baseline). Set before the first request.
    batch_decoding = True
    max_batch = MAX_BATCH  # requests per decode step; more wait for a row to free up

    # Passages of plain-string prompts (pc_rag.passages) are reused like chunks once sent (modular, blend; plan.py).
    # False: a plain string reuses only what was registered, discovered or marked, and its exact prefix.
    reuse_passages = True

    def __init__(self, model, tokenizer, store=None, auto_scaffold_after: int | None = None,
                 discovery: Discovery | None = None, prefetcher: Prefetcher | None = None):
        """`store`: a store object or spec (see `pc_rag.store.open_store`): "memory", "disk:PATH",
        "redis://host:port/db", or a list of those as tiers. Default: memory over a disk tier in
        $PC_RAG_CACHE_DIR (else ~/.cache/pc_rag).

        `auto_scaffold_after`: when the same chunks (in the same order) have come together in this many
        prompts, encode them jointly in the background and reuse the joint KV from then on. Off by default:
        each group costs its own copy of its chunks' KV (see `stats()["scaffolds"]`).

        `discovery` and `prefetcher`: where this engine finds the documents the framework hooks discovered, and the
        worker that prefetches their KV (pc_rag.text_index, pc_rag.prefetch); by default the process's own, which
        the hooks feed. Give an engine its own to keep it apart from the others in the process."""
        self.runner = LlamaRunner(model, tokenizer)
        self.tokenizer = tokenizer
        self.segmenter = SegmentTokenizer(tokenizer)
        self.store = open_store(store)
        # PML schemas are laid out at registration; their modules are encoded lazily, on first use, like
        # any chunk (an eager encode of a thousands-module schema would be minutes of work up front).
        self.schemas = SchemaRegistry(self.segmenter, self.runner.shape.max_positions)
        bos = self.segmenter.bos_id
        # Chunks are encoded after BOS: the first token of a sequence becomes an attention sink, and
        # without a shared sink each chunk's first token would play that role wherever it is placed.
        self.planner = Planner(self.runner.fingerprint, (bos,) if bos is not None else (),
                               rope_type=self.runner.rope_type, relocatable=self.runner.relocatable)
        self.assembler = Assembler(self.runner, self.store, self.planner)
        self.planner.passages.kv_bytes_per_token = self.runner.shape.kv_bytes_per_token(self.runner.dtype)
        # Blocks read from disk or Redis go to the model's device once, when promoted (a TieredStore; a store of one
        # tier places nothing, and lookups place what it returns).
        self.store.set_device(self.runner.device)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        # Constrained decoding (`grammar=`): grammars compiled for this tokenizer, kept LRU (pc_rag.grammar).
        self.grammars = Grammars(tokenizer, getattr(model.config, "vocab_size", None) or len(tokenizer), self.eos_ids)
        # Texts a plain-string prompt is cut at: chunks registered with this engine (`register`), replies it
        # generated (given back their generated tokens), and the documents the framework hooks discovered.
        self.chunks = ChunkIndex()
        self.replies = ReplyIndex()
        # Chat templates' message bounds (special tokens) are seams between passages wherever they stand.
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._passage_markers = marker_pattern([*getattr(tokenizer, "all_special_tokens", ()),
                                                *(t.content for t in added.values() if getattr(t, "special", False))])
        self.scaffolds = ScaffoldBuilder(self.planner, self.assembler, self._describe_group, auto_scaffold_after)
        # Handed in or the process's own: the documents the framework hooks discovered (this engine splits prompts
        # at them and prefetches them), and the worker that loads their KV in the background.
        self.discovery = discovery if discovery is not None else DISCOVERY
        self.discovery.watch(self)
        self.prefetcher = prefetcher if prefetcher is not None else PREFETCHER
        self._decoder: BatchDecoder | None = None  # built on the first batched request (max_batch read then)
        self._decoder_lock = threading.Lock()
        # Requests between the start of their prefill and their last token. One alone decodes on its own thread:
        # with the decode loop's thread computing too, two threads hold OpenMP teams, and on the 2-core machine
        # every parallel op then paid a wake-up (a lone decode ran at 65-70% of its speed with one idle extra
        # team, bench model, fp32 and bf16). A second request moves both into the shared loop.
        self._requests = 0
        self._requests_lock = threading.Lock()
        self.runner.others_decoding = lambda: self._requests > 1  # long prefills are chunked while others run
        # One prefill at a time, in arrival order (batch.py: a burst's first request answers after one prefill).
        self._prefill_turn = TurnLock()
        release_team()  # loading and packing the weights computed on this thread, which may serve none (threads.py)

    @classmethod
    def from_pretrained(cls, path_or_id: str, dtype="float32", device="cpu", store=None) -> Engine:
        device = check_device(device)  # before reading any weights: a missing GPU is a one-line error
        runner = LlamaRunner.from_pretrained(str(path_or_id), dtype=dtype, device=device)
        return cls(runner.model, runner.tokenizer, store=store)

    @property
    def model(self):
        return self.runner.model

    # ---- public API ------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, mode: str = "modular", max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Sequence[str] | None = None, seed: int | None = None,
                 recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO, cache_salt: str | None = None,
                 grammar: Grammar | None = None, *, n: int = 1, logprobs: int | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None) -> Generation:
        """Generate a reply; the arguments are those of `GenerationOptions` (checked before any work).
        `cache_salt`: the request's cache namespace (see the module docstring); `grammar`: constrained
        decoding (`pc_rag.Grammar`); `n`: replies to the one prompt (`Generation.choices`); `logprobs=k`: each
        token's log-probability and the k most likely (`Generation.logprobs`); `presence_penalty`,
        `frequency_penalty`, `logit_bias`: OpenAI's."""
        options = self.checked_options(GenerationOptions(
            mode, max_new_tokens, temperature, top_p, stop, seed, recompute_ratio, cache_salt, grammar, n, logprobs,
            presence_penalty, frequency_penalty, logit_bias))
        *_, generation = self._stream_generation(prompt, options)
        return generation

    def stream(self, prompt: Prompt, mode: str = "modular", max_new_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, stop: Sequence[str] | None = None, seed: int | None = None,
               recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO, cache_salt: str | None = None,
               grammar: Grammar | None = None, *, n: int = 1, logprobs: int | None = None,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               logit_bias: Mapping[int, float] | None = None) -> Iterator[str]:
        """Text pieces as they are decoded; never splits a multi-byte character or emits part of a stop string.
        With `logprobs`, every piece is a `decode.Piece` (a str) carrying its tokens' logprobs; with `n` > 1 the
        choices' pieces interleave, and `decode.choice_of(piece)` says which each belongs to.

        Not a generator function: the options are checked here, at the call, so a bad argument raises before
        the first `next()`."""
        options = self.checked_options(GenerationOptions(
            mode, max_new_tokens, temperature, top_p, stop, seed, recompute_ratio, cache_salt, grammar, n, logprobs,
            presence_penalty, frequency_penalty, logit_bias))
        return (item for item in self._stream_generation(prompt, options) if isinstance(item, str))

    def stream_generation(self, prompt: Prompt, mode: str = "modular", max_new_tokens: int = 32,
                          temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] | None = None,
                          seed: int | None = None, recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
                          cache_salt: str | None = None, grammar: Grammar | None = None, *, n: int = 1,
                          logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                          logit_bias: Mapping[int, float] | None = None) -> Iterator[str | Generation]:
        """Like `stream`, then the final `Generation` (token counts, TTFT) as the last item; options are
        checked at the call, as in `stream`."""
        options = self.checked_options(GenerationOptions(
            mode, max_new_tokens, temperature, top_p, stop, seed, recompute_ratio, cache_salt, grammar, n, logprobs,
            presence_penalty, frequency_penalty, logit_bias))
        return self._stream_generation(prompt, options)

    def checked_options(self, options: GenerationOptions) -> GenerationOptions:
        """`options`, once what they cannot check alone fits this engine: logit_bias ids in the vocabulary, n
        choices in one decode batch (else an OptionError). The server checks a request's options with it before
        the request waits in line."""
        vocab = getattr(self.model.config, "vocab_size", None) or len(self.tokenizer)
        if options.logit_bias and options.logit_bias[-1][0] >= vocab:  # sorted by id
            raise OptionError(f"logit_bias names token {options.logit_bias[-1][0]}, beyond the vocabulary of "
                              f"{vocab} tokens (ids 0 to {vocab - 1})")
        if options.n > self.max_batch:
            raise OptionError(f"n must be at most the engine's max_batch ({self.max_batch}): the choices decode as "
                              f"rows of one batch, got {options.n}")
        return options

    def _sampler(self, options: GenerationOptions, choice: int = 0) -> Sampler:
        """A sampler for reply `choice` of a request: its grammar state, its seed, the token names of logprobs."""
        grammar = self.grammars.state(options.grammar) if options.grammar is not None else None
        texts = None
        if options.logprobs is not None:
            texts = self._token_texts = getattr(self, "_token_texts", None) or TokenTexts(self.tokenizer)
        return Sampler(Sampling.from_options(options, choice), grammar, texts, choice)

    def _stream_generation(self, prompt: Prompt, options: GenerationOptions) -> Iterator[str | Generation]:
        steps = self._run(prompt, options)
        while True:
            try:
                piece = next(steps)
            except StopIteration as done:
                yield done.value
                return
            if piece:
                yield piece

    def explain(self, prompt: Prompt | str | PML, mode: str = "modular", cache_salt: str | None = None) -> Explanation:
        """Where a request for `prompt` would get its KV, piece by piece (tokens, slots, positions, and a memory,
        disk or Redis hit, an encode, or the forward), without running it: the plan a request would make, from
        answers that read nothing (`Store.where`). No forward pass runs and the store is left as it is (no block
        read, counted, promoted or written). A plain-string prompt is split as `generate` splits it; `cache_salt`:
        the namespace of the request explained (it sees what that request would). What it cannot know: a
        block's tokens (checked when a request reads it) and blend's recomputed share. A mode a request would
        refuse for this model (a RoPE that cannot be relocated, a failed relocation self-check) is refused."""
        namespace = checked_cache_salt(cache_salt)
        segments, _ = self._checked_segments(prompt, mode, namespace=namespace)
        if mode in REUSING_CHUNKS:  # refused as a request would be, by what is known without a forward pass
            self.runner.check_relocation(probe=False)
        plan = self.planner.plan(segments, mode, WhereLookups(self.store), namespace)
        rows = []
        for p in plan.pieces:
            kv = _LOADS[p.load].format(tier=p.origin)
            if p.members:
                kv += f" (an extent of {len(p.members)} blocks)"
            ids = list(plan.ids[p.slot: p.slot + min(p.n, 16)])
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            rows.append(ExplainRow(p.kind, p.n, (p.slot, p.slot + p.n), (p.position, p.position + p.n - 1),
                                   p.source, p.load, None if p.load == Load.ENCODE else p.origin, kv, p.key,
                                   repr(text[:40]) + ("..." if p.n > 16 else "")))
        return Explanation(mode, plan, tuple(rows))

    def register(self, texts: Iterable[str], public: bool = False) -> int:
        """Register document texts: wherever one appears in a plain-string prompt it becomes a `Chunk` (its KV
        cached and reused at any position in modular/blend modes). Returns how many were new.

        `public=True`: documents shared across cache namespaces (`cache_salt`): their KV is keyed in no namespace,
        so a request of any namespace reuses what any other stored for them, while the prompt around them stays
        in its own namespace. What a request can learn from them: whether a public document is cached."""
        return self.chunks.add_many(texts, public=bool(public))

    def prefetch(self, texts: Iterable[str], cache_salt: str | None = None) -> Future:
        """Start loading the cached KV of these document texts from the persistent tiers (disk, Redis) into
        memory, in the background; returns at once. The future resolves to the number of blocks brought into
        memory (0 when the store has no persistent tier under a memory tier, or holds none of them). A text is
        keyed as a chunk that follows a newline in a prompt string (its stripped text, tokenized on its own), in
        the namespace `cache_salt` (public documents in none)."""
        namespace = checked_cache_salt(cache_salt)
        texts = [t for t in texts if isinstance(t, str) and t.strip()]
        return self.prefetcher.submit(lambda: self._prefetch_now(texts, namespace))

    @releasing_team  # on the prefetch worker, which then idles
    def _prefetch_now(self, texts: list[str], namespace: str | None = None) -> int:
        if not self.store.can_prefetch:
            return 0
        segments = [TokenSegment("chunk", ids, 0, public=self.chunks.is_public(t))
                    for t, ids in ((t, self.segmenter.ids(t.strip(), namespace)) for t in texts) if ids]
        return self.store.prefetch(self.planner.chunk_keys(segments, namespace))

    def split(self, text: str, chunk_texts: Iterable[str] = (), discovered: bool = True,
              cache_salt: str | None = None) -> list[Text | Chunk]:
        """A plain-string prompt as segments: registered chunks (public ones as public `Chunk`s), `chunk_texts`
        (marked for this request) and, unless `discovered=False` or PC_RAG_DISCOVERY=0, documents the framework
        hooks discovered become `Chunk`s; replies this engine generated in namespace `cache_salt` (pass the
        request's) keep their generated tokens; the rest is `Text`, its passages (pc_rag.passages) marked
        `Text(passage=True)` unless `discovered=False` or `reuse_passages` is off. The tokens are those of the whole
        string (see `SegmentTokenizer.split`)."""
        if not isinstance(text, str):
            raise PromptError(f"split takes the prompt as a str, got {type(text).__name__}")
        namespace = checked_cache_salt(cache_salt)
        found = self.chunks.candidates(text) + self.replies.candidates(text, namespace) + marked(text, chunk_texts)
        if discovered:
            found += self.discovery.candidates(text)
        spans = resolve(found)
        # Passages need the token offsets (a fast tokenizer); `discovered=False` (an adapter's auto_chunks=False)
        # asks for no automatic chunks at all.
        if discovered and getattr(self.tokenizer, "is_fast", False) and self.reuse_passages:
            spans = with_passages(text, spans, self._passage_markers)
        return self.segmenter.split(text, spans)

    def pml(self, prompt: str) -> list[Text | Chunk]:
        """A PML prompt resolved against the registered schemas (same as passing `PML(prompt)`)."""
        return self.schemas.segments(prompt)

    def add_scaffold(self, chunks: Sequence[Chunk | str]) -> None:
        """Declare chunks that are retrieved together: whenever they appear in a prompt in this order (with
        only text between them), they are encoded jointly once and reused as one block, so inside the group
        each chunk sees the ones before it, as in a full prefill."""
        texts = [(c if isinstance(c, Chunk) else Chunk(c)).text for c in chunks]  # Chunk() checks the text
        group = [self.segmenter.ids(t) for t in texts]
        self.scaffolds.declare(group)

    def add_schema(self, pml: str) -> Schema:
        """Register a PML schema; later prompts may be PML `<prompt schema="...">` strings."""
        schema = self.schemas.add(pml)
        for texts in schema.scaffold_texts():
            if len(texts) >= 2:
                self.add_scaffold(texts)
        return schema

    @releasing_team
    def next_token_logits(self, prompt: Prompt, mode: str = "modular", recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
                          cache_salt: str | None = None) -> torch.Tensor:
        """Next-token logits after the prompt, [vocab] float32. Like `generate`, it leaves the prompt's prefix
        blocks behind (stored after the logits are computed, in namespace `cache_salt`), so scoring many
        continuations of one long context computes the context once."""
        options = GenerationOptions(mode=mode, recompute_ratio=recompute_ratio, cache_salt=cache_salt)
        asm = self._prefill(prompt, options.mode, extra_capacity=0, recompute_ratio=options.recompute_ratio,
                            namespace=options.cache_salt)
        try:
            self.assembler.save_prefix(asm)
        finally:
            self.runner.release_cache(asm.cache)
        self._remember_passages(asm.plan)
        return asm.logits

    @releasing_team
    def warm(self, chunks: Iterable[Chunk | str], progress: bool = True, cache_salt: str | None = None) -> int:
        """Encode and store chunk KV ahead of time, in namespace `cache_salt` (public chunks, `Chunk(public=True)`,
        in none); returns how many chunks were newly encoded."""
        from tqdm.auto import tqdm

        namespace = checked_cache_salt(cache_salt)
        if isinstance(chunks, (str, Chunk)):  # a lone string would be warmed character by character
            raise PromptError("warm takes a list of chunks (str or pc_rag.Chunk), not a single one: warm([chunk])")
        chunks = list(chunks)
        for i, c in enumerate(chunks):  # all checked before the first (slow) encode
            if not isinstance(c, (str, Chunk)):
                raise PromptError(f"warm: chunks[{i}] is a {type(c).__name__}; pass str or pc_rag.Chunk")
        encoded = 0
        for c in tqdm(chunks, desc="pc_rag: encoding chunks", unit="chunk", disable=not progress):
            c = Chunk(c) if isinstance(c, str) else c
            ids = self.segmenter.ids(c.text, namespace)
            if ids:
                segment = TokenSegment("chunk", ids, 0, c.encode_position, public=c.public)
                want = self.planner.chunk_wanted(segment, 0, namespace)
                encoded += self.assembler.ensure_stored(want) == COMPUTED
        return encoded

    def stats(self) -> dict:
        """Store tiers' counters; scaffolds: groups declared, bytes of their joint KV, automatic builds that
        failed (each logged on the "pc_rag" logger); prefix blocks this process's index knows; texts registered
        as chunks with this engine and replies it remembers; passages: passages of plain-string prompts remembered
        (`indexed`, in `namespaces`), and what they did (`PassageCounts`); decode: batched decode steps, the tokens they
        produced (first_tokens of them the requests' first, after the prompt_tokens the steps computed for
        them), the largest batch seen, requests decoding and waiting for a row now; relocation_check: the
        RoPE relocation self-check of this model (run before its first modular or blend request; None before)."""
        groups, failed = self.scaffolds.snapshot()  # background builds may add groups meanwhile
        decoder = self._decoder
        check = self.runner.relocation_check
        decode = decoder.stats() if decoder is not None else {
            "active": 0, "waiting": 0, "steps": 0, "tokens": 0, "max_batch": self.max_batch, "max_batch_seen": 0,
            "first_tokens": 0, "prompt_tokens": 0}
        return {"tiers": [vars(s).copy() for s in self.store.tier_stats()],
                "scaffolds": {"groups": sum(len(g) for g in groups), "bytes": self.assembler.scaffold_bytes,
                              "failed": failed},
                "prefix": {"blocks_indexed": len(self.planner.prefixes), "block_tokens": self.planner.block_tokens},
                "registered": {"chunks": len(self.chunks), "replies": len(self.replies)},
                "passages": self.planner.passages.stats(),
                "decode": decode,
                "backends": self.runner.backends.as_dict(),
                "relocation_check": check.as_dict() if check is not None else None}

    def wait_for_background(self, timeout: float | None = None) -> None:
        """Wait for background work (automatic scaffold encodes) to finish."""
        self.scaffolds.wait(timeout)

    # ---- the request path ------------------------------------------------------------------------------
    def _segments(self, prompt: Prompt | str | PML, namespace: str | None = None):
        if isinstance(prompt, PML):
            prompt = self.schemas.segments(prompt.text)
        elif isinstance(prompt, str):
            prompt = self.split(prompt, cache_salt=namespace)
        return self.segmenter.segments(prompt, namespace)

    def _checked_segments(self, prompt: Prompt | str | PML, mode: str, extra_capacity: int = 0,
                          namespace: str | None = None) -> tuple[list[TokenSegment], int]:
        """The prompt's token segments, checked against the model's context, and the extra capacity its decoding
        can use (bounded by the positions left)."""
        if mode not in MODES:
            raise PromptError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        segments = self._segments(prompt, namespace)
        last = max(s.end for s in segments)
        shape = self.runner.shape
        if last > shape.max_positions:
            raise PromptError(
                f"the prompt needs position ids up to {last}, beyond the model's context of "
                f"{shape.max_positions} tokens: drop chunks or shorten the text"
            )
        # Decoding stops where positions run out, so no more slots than that can be written: without this
        # bound, max_new_tokens=10**9 asked the pool for a billion-token buffer.
        extra_capacity = min(extra_capacity, shape.max_positions - segments[-1].end)
        return segments, extra_capacity

    def _prefill(self, prompt: Prompt | str, mode: str, extra_capacity: int, recompute_ratio: float,
                 namespace: str | None = None, defer: int = 0) -> Assembled:
        """The request path up to the first logits, step by step: segments, plan (the store asked once, through
        lookups that keep what they found), then encode, build and forward (`Assembler.assemble`); every key in
        the request's cache `namespace`."""
        segments, extra_capacity = self._checked_segments(prompt, mode, extra_capacity, namespace)
        if mode in REUSING_CHUNKS:  # refused (UnsupportedModelError) where relocated keys would be wrong
            self.runner.check_relocation()
        recompute = Recompute(recompute_ratio, self.blend_selection) if mode == "blend" else None
        lookups = self.assembler.lookups()
        plan = self.planner.plan(segments, mode, lookups, namespace)
        if mode in ("modular", "blend"):
            self.scaffolds.observe(segments, namespace)
        return self.assembler.assemble(plan, lookups.blocks, extra_capacity, recompute, defer)

    def _describe_group(self, group) -> str:
        def preview(ids):
            try:
                text = self.tokenizer.decode(list(ids[:12]), skip_special_tokens=True)
            except Exception:  # describing the failure must not fail in turn
                text = f"token ids {list(ids[:6])}"
            return f"{text!r}... ({len(ids)} tokens)"

        return f"{len(group)} chunks: " + ", ".join(preview(ids) for ids in group)

    @contextlib.contextmanager
    def _counted(self):
        with self._requests_lock:
            self._requests += 1
        try:
            yield
        finally:
            with self._requests_lock:
                self._requests -= 1

    def _run(self, prompt, options: GenerationOptions) -> Iterator[str]:
        with self._counted():
            if options.n > 1:  # one prefill, n rows (choices.py)
                run = yield from run_choices(self, prompt, options)
                asm, first = run.asm, run.choices[0]
                return Generation(
                    text=first.text, token_ids=first.token_ids, mode=options.mode, finish_reason=first.finish_reason,
                    prompt_tokens=asm.prompt_tokens, cached_tokens=asm.cached_tokens,
                    computed_tokens=asm.computed_tokens, stored_tokens=asm.plan.as_built().stored_tokens,
                    recomputed_tokens=asm.recomputed_tokens, ttft_s=run.ttft_s, total_s=run.total_s,
                    sources=tuple(SegmentSource(p.kind, p.n, p.source, p.origin) for p in asm.pieces),
                    prompt_ids=asm.plan.ids, plan=asm.plan, logprobs=first.logprobs,
                    inter_token_s=first.inter_token_s, choices=run.choices)
            return (yield from self._run_counted(prompt, options))

    def _run_counted(self, prompt, options: GenerationOptions) -> Iterator[str]:
        t0 = time.perf_counter()
        mode, max_new_tokens = options.mode, options.max_new_tokens
        sampler = self._sampler(options)
        # While other requests decode, a prompt whose tokens to compute are its last ones (a question after
        # cached chunks, a chat turn, a prompt sent again), at most a chunk of them, leaves them to the shared
        # decode step, as one more row: its first token then costs a share of a batched step instead of a
        # forward of its own between two steps, and a burst of new questions is computed in one or two steps
        # (docs/speed.md#batching-and-concurrent-streams). Not when the batch is full: the first token would wait
        # for a row to leave.
        decoder = self._decoder
        defer = (self.runner.prefill_chunk_tokens if self.batch_decoding and self._requests > 1
                 and (decoder is None or decoder.has_room()) else 0)
        with self._prefill_turn if self.batch_decoding else contextlib.nullcontext():
            asm = self._prefill(prompt, mode, extra_capacity=max_new_tokens, recompute_ratio=options.recompute_ratio,
                                namespace=options.cache_salt, defer=defer)
        tail = slice(asm.prompt_tokens - asm.deferred, asm.prompt_tokens)  # the tokens left to the step
        tail_ids, tail_positions = list(asm.plan.ids[tail]), list(asm.plan.positions[tail])
        deferred = asm.logits is None
        if deferred and tail_ids[-1] in self.eos_ids:  # the loop takes no row after an EOS token: compute it here
            asm.cache.length = asm.prompt_tokens
            asm = replace(asm, logits=self.runner.forward(asm.cache, tail_ids, tail_positions,
                                                          list(range(tail.start, tail.stop))))
            deferred = False
        token = None if deferred else sampler(asm.logits)
        ttft = time.perf_counter() - t0

        text = TextStream(self.tokenizer, options.stop)
        ids: list[int] = []
        finish = "length"
        room = self.runner.shape.max_positions - 1 - asm.last_position  # positions left for new tokens
        steps = None
        done = False  # the reply ran to its end (not an abandoned stream)
        try:
            needed = decode_steps_needed(max_new_tokens, room)
            if deferred:  # the prompt's last tokens as a row of the shared step, which chooses the first token
                steps = self._join_batch(asm.cache, sampler, tail_ids, tail_positions, tail.start, needed + 1,
                                         prompt=True)
                token = steps.next()
                ttft = time.perf_counter() - t0
            elif self.batch_decoding and self._requests > 1:
                steps = self._join_batch(asm.cache, sampler, [token], [asm.last_position + 1], asm.prompt_tokens,
                                         needed)
            for i in range(max_new_tokens):
                ids.append(token)
                if token in self.eos_ids:
                    finish = "stop"
                    yield sampler.piece(text.finish(), len(ids))
                    break
                yield sampler.piece(text.push(token), len(ids))
                if text.stopped:
                    finish = "stop"
                    break
                if i + 1 == max_new_tokens or i + 1 > room:
                    yield sampler.piece(text.finish(), len(ids))
                    break
                if steps is None:
                    pos, slot = asm.last_position + 1 + i, asm.prompt_tokens + i
                    token = sampler(self.runner.forward(asm.cache, [token], [pos], [slot]))
                    if self.batch_decoding and self._requests > 1:  # another request came: decode in one loop
                        steps = self._join_batch(asm.cache, sampler, [token], [pos + 1], slot + 1, needed - i - 1)
                else:
                    token = steps.next()
            done = True
        finally:  # also when a stream is abandoned: the generator is closed and the buffer returns to the pool
            total = time.perf_counter() - t0
            try:
                if steps is not None:  # leave the batch first: the decode loop no longer writes the buffer
                    steps.close()
                # Stored once the reply is out, not between its tokens: writing a 4K-token prefix to disk or
                # Redis would otherwise stall the stream right after the first token (the benchmark saw it as
                # slower exact-mode decoding). Every token but the last was fed back, so its KV is in the
                # cache: the next turn of a chat reuses the prompt and the reply.
                # Deferred tokens with no first token out may never have been computed: nothing to store.
                if ids or not deferred:
                    saved = self.assembler.save_prefix(asm, ids[:-1])
                    self._remember_reply(prompt, text.text, ids, asm if done else None, saved, options.cache_salt)
                    self._remember_passages(asm.plan)
            finally:
                self.runner.release_cache(asm.cache)
                release_team()  # a server's request thread waits for its next request (pc_rag/model/threads.py)
        return Generation(
            text=text.text,
            token_ids=tuple(ids),
            mode=mode,
            finish_reason=finish,
            prompt_tokens=asm.prompt_tokens,
            cached_tokens=asm.cached_tokens,
            computed_tokens=asm.computed_tokens,
            recomputed_tokens=asm.recomputed_tokens,
            stored_tokens=asm.plan.as_built().stored_tokens,
            ttft_s=ttft,
            total_s=total,
            sources=tuple(SegmentSource(p.kind, p.n, p.source, p.origin) for p in asm.pieces),
            prompt_ids=asm.plan.ids,
            plan=asm.plan,
            logprobs=sampler.logprobs(len(ids)),
            inter_token_s=sampler.gaps(len(ids)),
        )

    def _join_batch(self, cache, sampler: Sampler, tokens: list[int], positions: list[int], slot: int,
                    steps: int, prompt: bool = False) -> RowTokens:
        """The request's place in the shared decode loop, after `tokens` (at `positions`, their KV to go to slots
        from `slot` on: the first token chosen, or the prompt's tokens left to compute), for at most `steps` more
        forward passes. The loop starts computing the next token now, while this thread hands out the first."""
        with self._decoder_lock:
            if self._decoder is None:
                self._decoder = BatchDecoder(self.runner.step, self.eos_ids, self.max_batch, release_team,
                                             self.runner.prefill_chunk_tokens)
        joined = self._decoder.join(cache, sampler, tokens, positions, slot, steps, prompt)
        release_team()  # this thread now waits for the loop's tokens (pc_rag/model/threads.py)
        return joined

    def _remember_reply(self, prompt, text: str, ids: list[int], asm: Assembled | None = None,
                        saved: frozenset[str] = frozenset(), namespace: str | None = None) -> None:
        """Remember the reply's generated tokens for its text, as generated and as a chat template writes it
        back (trimmed), so the next turn's prompt (in the same cache `namespace`) carries these very tokens (see
        text_index.ReplyIndex).

        When trimming changes the reply's first or last token (" Hello" written back as "Hello"), the KV of
        the generated tokens cannot serve the next turn: with `asm` (a reply that ran to its end), the trimmed
        reply is run once over the prompt's cache, after the reply is out, and stored as the prefix's other
        continuation, so a chat's next turn still reuses the previous reply. It costs one forward over the
        reply's tokens (a fraction of decoding them) and only when the template's trim would lose them.

        A reply with a thinking block (pc_rag.reasoning) is written back by chat templates as its answer alone
        (Qwen3's drops earlier turns' thinking): the answer is remembered after the prompt too, and run over the
        prompt's cache the same way, so the next turn reuses the prompt and the answer."""
        if isinstance(prompt, str):
            after = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(s, (Text, Chunk)) for s in prompt):
            after = "".join(s.text for s in prompt)
        else:
            return  # PML: its text is not the prompt's text
        if not text.strip():
            return
        answer = ThinkingMarkers.detect(self.tokenizer).answer(text)
        if answer:
            self._remember_continuation(answer, after, asm, saved, namespace)

        def decode(t):
            return self.tokenizer.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        end = len(ids)
        while end and decode(ids[:end]) != text:  # EOS, or a stop string, may end the text before the ids
            end -= 1
            if len(text) - len(decode(ids[:end])) > 64:
                end = 0  # not a prefix of the ids' text: give up rather than decode the reply n times
        if not end:
            return
        self.replies.remember(text, ids[:end], after, namespace)
        stripped = text.strip()
        if stripped != text:
            start = 0
            while start < end and not decode(ids[start:start + 1]).strip():
                start += 1
            while end > start and not decode(ids[end - 1:end]).strip():
                end -= 1
            if decode(ids[start:end]) == stripped:
                self.replies.remember(stripped, ids[start:end], after, namespace)
                return
            self._remember_continuation(stripped, after, asm, saved, namespace)

    def _remember_continuation(self, text: str, after: str, asm: Assembled | None, saved: frozenset[str],
                               namespace: str | None) -> None:
        """Remember `text`, which the model did not generate as such right after the prompt `after` (a trimmed
        reply, or the answer after a thinking block), as that prompt's reply, with the ids the next turn's prompt
        tokenizes it into; with `asm`, run them over the prompt's cache and store them as its other
        continuation.

        Only while no other request is running: the forward is speculative (a next turn may never come) and
        would take the runner's turns from requests that are decoding (two such forwards took 150 ms of an
        8-stream burst's 1.2 s, bench model). Skipped, the next turn computes the same tokens as fresh ones."""
        alt = self.segmenter.ids(text, namespace)  # how the next turn's prompt tokenizes it (a hard cut)
        self.replies.remember(text, alt, after, namespace)
        if asm is None or self._requests > 1:  # this request is counted until it returns
            return
        if self._continues_layout(asm) and len(alt) <= asm.cache.capacity - asm.prompt_tokens:
            first = asm.last_position + 1
            slots = list(range(asm.prompt_tokens, asm.prompt_tokens + len(alt)))
            self.runner.forward(asm.cache, list(alt), list(range(first, first + len(alt))), slots)
            self.assembler.save_prefix(asm, alt, skip=saved)

    def _remember_passages(self, plan: Plan) -> None:
        """After the reply: count what the prompt's passages did, remember them as sent in the request's namespace
        and, while no other request runs, encode and store the ones whose own encoding is not stored, so that the
        next request finds them wherever they land (docs/design.md, "Passages"). The encodes cost about one
        prefill of the new passages, after the reply, never before the first token; a busy engine skips them (the
        passages are then encoded by the first request that reuses them). Best effort: a failure is logged."""
        if not plan.passages:
            return
        index = self.planner.passages
        reused = [p for p in plan.as_built().pieces if p.kind == "passage"]
        encoded = {p.key for p in reused if p.origin == COMPUTED}
        index.count(requests=1, reused=sum(p.key not in encoded for p in reused),
                    reused_tokens=sum(p.n for p in reused if p.key not in encoded), encoded=len(encoded))
        index.add(plan.namespace, ((w.key, len(w.token_ids)) for w in plan.passages))
        if self._requests > 1:  # this request is counted until it returns
            return
        todo = {w.key: w for w in plan.passages if w.key not in plan.passages_held and w.key not in encoded}
        try:
            for want in todo.values():
                if self._requests > 1:
                    break
                index.count(encoded_after_reply=self.assembler.ensure_stored(want) == COMPUTED)
        except Exception:  # speculative work: the reply is out and must stay a success
            log.warning("encoding a prompt's passages after the reply failed", exc_info=True)

    @staticmethod
    def _continues_layout(asm: Assembled) -> bool:
        """True when the request's stored prefix runs to the prompt's end (so a reply continues it)."""
        layout = asm.plan.layout
        return bool(layout) and getattr(layout[-1], "end", None) == asm.prompt_tokens
