"""The engine: what requests share (the model runner, the store, the indexes of texts and passages, the decode
loop) and the public API. A request's life is request.py, in the order it runs:

    prompt -> token segments (segments.py, text_index.py) -> plan (plan.py) -> prefill (assemble.py)
    -> decode (decode.py, batch.py) -> what it leaves for the next requests (after_reply.py) -> Generation

`Engine.explain` (explain.py) runs only the planning step, on answers that read nothing (`Store.where`).

Cache namespaces: every call that plans, stores or splits a prompt takes `cache_salt=` (None: no namespace, the
keys of earlier versions). A request reuses only what requests with the same salt stored, plus public chunks
(`register(texts, public=True)`, `Chunk(public=True)`); the reply index, the passage index, the tokenizer's memo
and automatic scaffolds are kept per namespace too (blocks.py says how keys carry it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from . import align
from .align import APE, ape_for, check_align
from .assemble import Assembler
from .batch import MAX_BATCH, BatchDecoder, Traffic
from .errors import OptionError, PromptError
from .explain import Explanation, explain
from .grammar import Grammar, Grammars
from .model import LlamaRunner, release_team, releasing_team
from .options import DEFAULT_RECOMPUTE_RATIO, GenerationOptions, check_device, check_mode, checked_cache_salt
from .passages import tokenizer_markers
from .plan import COMPUTED, Planner
from .pml import PML, Schema, SchemaRegistry
from .prefetch import PREFETCHER, Prefetcher
from .quality import Calibration, calibrate_ape, deviation_reference, gate
from .request import Generation, Request, next_token_logits
from .scaffolds import ScaffoldBuilder
from .segments import Chunk, Prompt, SegmentTokenizer, Text, TokenSegment, check_text, chunk_list
from .store import disk_folder, open_store
from .text_index import DISCOVERY, ChunkIndex, Discovery, ReplyIndex, marked, resolve, with_passages

log = logging.getLogger("pc_rag")


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
    # Blend's quality target for requests that give none (`recompute_target`): None keeps `recompute_ratio`.
    recompute_target: float | None = None
    # The gate per model (quality.calibrate): with a bound, the first modular or blend request measures modular's
    # agreement with full on built-in prompts, and modular is refused on this model when it is below the bound.
    # Off (None) by default: it costs two prefills per built-in prompt at first use, and its prompts are English.
    min_agreement: float | None = None
    # Documents the framework hooks discover are prefetched from disk/Redis into memory (pc_rag.prefetch).
    prefetch_on_discover = True

    # Requests that decode at the same time share one forward pass per step (batch.py: continuous batching;
    # greedy tokens equal one-at-a-time runs, tests/test_batch.py).
    max_batch = MAX_BATCH  # requests per decode step; more wait for a row to free up

    # Passages of plain-string prompts (pc_rag.passages) are reused like chunks once sent (modular, blend; plan.py).
    # False: a plain string reuses only what was registered, discovered or marked, and its exact prefix.
    reuse_passages = True
    # True: a passage is encoded on its own and reused from its first sight, as a marked document is, instead of
    # computed in its prompt and encoded after the reply once the engine is idle (docs/design.md "Passages"). A
    # server under load is never idle, so by the default rule a document that comes back is encoded on the request
    # path on top of its first prompt's compute; this setting makes each encode once. Off by default: a prompt
    # whose passages are all new then gets modular's approximation instead of being computed exactly.
    passages_from_first_sight = False

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
        self.eos_ids = self.runner.eos_ids
        # Constrained decoding (`grammar=`): grammars compiled for this tokenizer, kept LRU (pc_rag.grammar).
        self.grammars = Grammars(tokenizer, self.runner.vocab_size, self.eos_ids)
        # Texts a plain-string prompt is cut at: chunks registered with this engine (`register`), replies it
        # generated (given back their generated tokens), and the documents the framework hooks discovered.
        self.chunks = ChunkIndex()
        self.replies = ReplyIndex()
        self._passage_markers = tokenizer_markers(tokenizer)  # chat templates' message bounds: seams of passages
        self.scaffolds = ScaffoldBuilder(self.planner, self.assembler, tokenizer, auto_scaffold_after)
        # Handed in or the process's own: the documents the framework hooks discovered (this engine splits prompts
        # at them and prefetches them), and the worker that loads their KV in the background.
        self.discovery = discovery if discovery is not None else DISCOVERY
        self.discovery.watch(self)
        self.prefetcher = prefetcher if prefetcher is not None else PREFETCHER
        # What running requests share: their count, the prefill turn, the decode loop (built on the first batched
        # request: max_batch is read then).
        self.traffic = Traffic(lambda: BatchDecoder(self.runner.step, self.eos_ids, self.max_batch, release_team,
                                                    self.runner.prefill_chunk_tokens), release_team)
        self.measured_deviation: dict[str, float] = {}  # quality.deviation_reference per probe, once measured
        self.calibration: Calibration | None = None  # quality.calibrate, once measured (min_agreement set)
        # APE's pair for align="ape" requests (align.py): None takes this model's calibration in this process
        # (`calibrate_ape`, or the one saved in `calibration_dir`), else align.DEFAULT.
        self.ape: APE | None = None
        # Where `calibrate_ape` saves its pair and where it is found at start: the store's disk folder, if any.
        self.calibration_dir: Path | None = None
        if (folder := disk_folder(self.store)) is not None:
            self.keep_calibrations_in(folder)
        self.runner.others_decoding = self.traffic.busy  # long prefills are chunked while others run
        release_team()  # loading and packing the weights computed on this thread, which may serve none (threads.py)

    @classmethod
    def from_pretrained(cls, path_or_id: str, dtype="float32", device="cpu", store=None,
                        quantize: str | None = None) -> Engine:
        """A checkpoint folder or a GGUF file (its weights kept in the file's quantized formats); `quantize`
        ("q8_0", "q4_0", "q4_k") quantizes a float checkpoint as it loads. `dtype`: the activations' (and any float
        weight's) dtype."""
        device = check_device(device)  # before reading any weights: a missing GPU is a one-line error
        runner = LlamaRunner.from_pretrained(str(path_or_id), dtype=dtype, device=device, quantize=quantize)
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
                 logit_bias: Mapping[int, float] | None = None, recompute_target: float | None = None,
                 align: str | None = None) -> Generation:
        """Generate a reply; the arguments are those of `GenerationOptions` (checked before any work).
        `cache_salt`: the request's cache namespace (see the module docstring); `grammar`: constrained
        decoding (`pc_rag.Grammar`); `n`: replies to the one prompt (`Generation.choices`); `logprobs=k`: each
        token's log-probability and the k most likely (`Generation.logprobs`); `presence_penalty`,
        `frequency_penalty`, `logit_bias`: OpenAI's; `recompute_target`: blend recomputes what this prompt needs
        for that quality target (assemble.Recompute; `Generation.deviation` says what its probe measured);
        `align="ape"` (modular, blend): APE's temperature and scale on the attention over the reused chunks
        (pc_rag.align; the pair is `ape`, else the model's calibration, else the default)."""
        options = self.checked_options(GenerationOptions(
            mode, max_new_tokens, temperature, top_p, stop, seed, recompute_ratio, cache_salt, grammar, n, logprobs,
            presence_penalty, frequency_penalty, logit_bias, recompute_target, align))
        *_, generation = self._stream_generation(prompt, options)
        return generation

    def stream(self, prompt: Prompt, mode: str = "modular", max_new_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, stop: Sequence[str] | None = None, seed: int | None = None,
               recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO, cache_salt: str | None = None,
               grammar: Grammar | None = None, *, n: int = 1, logprobs: int | None = None,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               logit_bias: Mapping[int, float] | None = None, recompute_target: float | None = None,
               align: str | None = None) -> Iterator[str]:
        """Text pieces as they are decoded; never splits a multi-byte character or emits part of a stop string.
        With `logprobs`, every piece is a `decode.Piece` (a str) carrying its tokens' logprobs; with `n` > 1 the
        choices' pieces interleave, and `decode.choice_of(piece)` says which each belongs to.

        Not a generator function: the options are checked here, at the call, so a bad argument raises before
        the first `next()`."""
        options = self.checked_options(GenerationOptions(
            mode, max_new_tokens, temperature, top_p, stop, seed, recompute_ratio, cache_salt, grammar, n, logprobs,
            presence_penalty, frequency_penalty, logit_bias, recompute_target, align))
        return (item for item in self._stream_generation(prompt, options) if isinstance(item, str))

    def stream_generation(self, prompt: Prompt, mode: str = "modular", max_new_tokens: int = 32,
                          temperature: float = 0.0, top_p: float = 1.0, stop: Sequence[str] | None = None,
                          seed: int | None = None, recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
                          cache_salt: str | None = None, grammar: Grammar | None = None, *, n: int = 1,
                          logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                          logit_bias: Mapping[int, float] | None = None,
                          recompute_target: float | None = None,
                          align: str | None = None) -> Iterator[str | Generation]:
        """Like `stream`, then the final `Generation` (token counts, TTFT) as the last item; options are
        checked at the call, as in `stream`."""
        options = self.checked_options(GenerationOptions(
            mode, max_new_tokens, temperature, top_p, stop, seed, recompute_ratio, cache_salt, grammar, n, logprobs,
            presence_penalty, frequency_penalty, logit_bias, recompute_target, align))
        return self._stream_generation(prompt, options)

    def checked_options(self, options: GenerationOptions) -> GenerationOptions:
        """`options`, once what they cannot check alone fits this engine: logit_bias ids in the vocabulary, n
        choices in one decode batch (else an OptionError). The server checks a request's options with it before
        the request waits in line."""
        vocab = self.runner.vocab_size
        if options.logit_bias and options.logit_bias[-1][0] >= vocab:  # sorted by id
            raise OptionError(f"logit_bias names token {options.logit_bias[-1][0]}, beyond the vocabulary of "
                              f"{vocab} tokens (ids 0 to {vocab - 1})")
        if options.n > self.max_batch:
            raise OptionError(f"n must be at most the engine's max_batch ({self.max_batch}): the choices decode as "
                              f"rows of one batch, got {options.n}")
        return options

    def _stream_generation(self, prompt: Prompt, options: GenerationOptions) -> Iterator[str | Generation]:
        for item in Request(self, options).run(prompt):  # pieces, the Generation, then the leftovers (request.py)
            if not isinstance(item, str) or item:
                yield item

    def explain(self, prompt: Prompt | str | PML, mode: str = "modular", cache_salt: str | None = None,
                align: str | None = None) -> Explanation:
        """Where a request for `prompt` would get its KV, piece by piece (tokens, slots, positions, and a memory,
        disk or Redis hit, an encode, or the forward), without running it (pc_rag.explain): it answers "why was
        this slow, why did nothing hit" on a live engine. A plain-string prompt is split as `generate` splits it;
        `cache_salt`: the namespace of the request explained (it sees what that request would); `align`: as
        `generate`'s (the APE pair it would use is shown)."""
        check_mode(mode)
        ape = ape_for(self) if check_align(align, mode) == "ape" else None
        return explain(self, prompt, mode, checked_cache_salt(cache_salt), ape)

    def calibrate_ape(self, prompts=None, **grid) -> tuple[APE, dict]:
        """Choose APE's temperature and scale for this model (quality.calibrate_ape: a grid searched for the pair
        closest to full's next token, on `prompts` or the built-in ones; `temperatures=`, `scales=` another grid), and
        use it from now on (`ape`); saved in `calibration_dir` (if set) for the engines started on it later. Returns
        the pair and what each pair tried measured."""
        return calibrate_ape(self, prompts, **grid)

    def keep_calibrations_in(self, folder: str | Path) -> None:
        """Save `calibrate_ape`'s pair in `folder` from now on, and take the one it holds for this model now (unless
        this process calibrated the model itself): a store without a disk tier can still share a cache folder's
        calibration (`pc-rag check`)."""
        self.calibration_dir = Path(folder)
        align.remember_saved(self.calibration_dir, self.planner.fingerprint)

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
        texts = [t for i, t in enumerate(texts) if isinstance(t, str) and check_text(t, f"texts[{i}]").strip()]
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
        check_text(text, "the prompt string")
        if isinstance(chunk_texts, str):  # a lone string would be taken character by character
            raise PromptError("chunk_texts takes a list of texts, not a single one: chunk_texts=[text]")
        chunk_texts = [check_text(t, f"chunk_texts[{i}]") for i, t in enumerate(chunk_texts)]
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
        group = [self.segmenter.ids(c.text) for c in chunk_list(chunks, "add_scaffold")]
        self.scaffolds.declare(group)

    def add_schema(self, pml: str) -> Schema:
        """Register a PML schema; later prompts may be PML `<prompt schema="...">` strings."""
        schema = self.schemas.add(pml)
        for texts in schema.scaffold_texts():
            if len(texts) >= 2:
                self.add_scaffold(texts)
        return schema

    def next_token_logits(self, prompt: Prompt, mode: str = "modular", recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
                          cache_salt: str | None = None, recompute_target: float | None = None,
                          align: str | None = None) -> torch.Tensor:
        """Next-token logits after the prompt, [vocab] float32. Like `generate`, it leaves the prompt's prefix
        blocks behind (stored after the logits are computed, in namespace `cache_salt`), so scoring many
        continuations of one long context computes the context once."""
        return next_token_logits(self, prompt, GenerationOptions(
            mode=mode, recompute_ratio=recompute_ratio, cache_salt=cache_salt, recompute_target=recompute_target,
            align=align))

    @releasing_team
    def warm(self, chunks: Iterable[Chunk | str], progress: bool = True, cache_salt: str | None = None) -> int:
        """Encode and store chunk KV ahead of time, in namespace `cache_salt` (public chunks, `Chunk(public=True)`,
        in none); returns how many chunks were newly encoded."""
        from tqdm.auto import tqdm

        namespace = checked_cache_salt(cache_salt)
        encoded = 0
        for c in tqdm(chunk_list(chunks, "warm"), desc="pc_rag: encoding chunks", unit="chunk", disable=not progress):
            ids = self.segmenter.ids(c.text, namespace)
            if ids:
                segment = TokenSegment("chunk", ids, 0, c.encode_position, public=c.public)
                want = self.planner.chunk_wanted(segment, 0, namespace)
                encoded += self.assembler.ensure_stored(want) == COMPUTED
        return encoded

    def check(self, prompts, modes=None, max_new_tokens: int = 16, target: float = 0.9, progress: bool = True):
        """Each reusing mode against full on these prompts (`pc_rag.check.check`: agreement of greedy answers, first
        divergence, KL along full's answer, TTFT, the cheapest mode within `target`); a `CheckReport`."""
        from .check import DEFAULT_MODES, check

        return check(self, prompts, modes if modes is not None else DEFAULT_MODES, max_new_tokens, target, progress)

    def check_quality(self, mode: str) -> None:
        """The gate per model (`min_agreement`, quality.gate): raises where it refuses `mode`."""
        gate(self, mode)

    def deviation_reference(self, select: str | None = None) -> float:
        """This model's typical deviation of a reused chunk as blend's `select` (default: `blend_selection`)
        probes it (quality.py), measured on first use."""
        return deviation_reference(self, select or self.blend_selection)

    def stats(self) -> dict:
        """tiers: the store's counters; scaffolds: groups, bytes of their joint KV, failed builds (each logged);
        prefix: blocks indexed; registered: chunks and remembered replies; tokenizer_memo: texts whose tokens are
        kept; grammars: compiled and kept, compiles so far; passages: those remembered and what they did
        (`PassageCounts`); encodes: chunks and passages encoded on their own, on requests' paths, after replies and
        elsewhere (warm, scaffolds): batched forwards, chunks and tokens (`EncodeCounts`); decode: the shared loop's
        steps, tokens (first_tokens, prompt_tokens), largest batch, rows decoding and waiting; backends; model: the
        loaded model's bytes, dtype and matrices by format (LlamaRunner.memory); relocation_check and quality_gate:
        None until they ran. The indexes are bounded (each class says how), so a long-running server's figures stop
        growing at their bounds."""
        groups, failed = self.scaffolds.snapshot()  # background builds may add groups meanwhile
        check = self.runner.relocation_check
        return {"tiers": [vars(s).copy() for s in self.store.tier_stats()],
                "scaffolds": {"groups": sum(len(g) for g in groups), "bytes": self.assembler.scaffold_bytes,
                              "failed": failed},
                "prefix": {"blocks_indexed": len(self.planner.prefixes), "block_tokens": self.planner.block_tokens},
                "registered": {"chunks": len(self.chunks), "replies": len(self.replies)},
                "tokenizer_memo": dict(zip(("entries", "chars"), self.segmenter.memo_size(), strict=True)),
                "grammars": {"compiled": len(self.grammars), "compiles": self.grammars.compiles},
                "passages": self.planner.passages.stats(),
                "encodes": {where: c.as_dict() for where, c in self.assembler.encodes.items()},
                "decode": self.traffic.stats(self.max_batch),
                "backends": self.runner.backends.as_dict(),
                "model": self.runner.memory(),
                "relocation_check": check.as_dict() if check is not None else None,
                "quality_gate": None if self.calibration is None else {
                    "min_agreement": self.min_agreement, **self.calibration.as_dict()}}

    def wait_for_background(self, timeout: float | None = None) -> None:
        """Wait for background work (automatic scaffold encodes) to finish."""
        self.scaffolds.wait(timeout)
