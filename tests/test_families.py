"""Every supported family through every mode, on a tiny random-weight checkpoint of its real HF config class
(pc_rag.testing.TINY_FAMILIES: windows of 32 tokens, mixed layer kinds, soft-caps and multipliers switched on),
saved and loaded with `from_pretrained`.

References and tolerances (fp32): HF's own forward of the family (`reference_logits`) and HF's `generate` for
`full`, <= 1e-4 and the same greedy tokens; `full` for `exact`, blend at ratio 1 and a lone chunk in `modular`,
<= 1e-4 (copies and relocations add rounding); one-at-a-time decoding for batched decoding, bit-equal for one
request and <= 1e-5 for four (the products over four rows round differently); a memory store for a disk round
trip, <= 1e-5 (the reader computes the system text that the memory engine copies from a block it saved in this
process, in a forward of more rows: 1.0e-6 apart on a CPU without AVX-512, where torch's products round by row
count). Prompts are several windows long, so every windowed layer masks keys that full attention would see.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model import rope as rope_module
from pc_rag.store import MemoryStore
from pc_rag.testing import TINY_FAMILIES, build_tiny

from .conftest import prompt_ids
from .test_batch import _check_decode_batch, _check_forward_rows
from .test_engine import rag_prompt

FAMILIES = sorted(TINY_FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, model, tokenizer): the family's tiny checkpoint, built and loaded once per module."""
    path = build_tiny(tmp_path_factory.mktemp(request.param), request.param)
    base = pc_rag.Engine.from_pretrained(path, store="memory")
    assert base.runner.arch.model_type == request.param
    return request.param, base.model, base.tokenizer


def fresh(family, store=None):
    _, model, tokenizer = family
    return pc_rag.Engine(model, tokenizer, store=store or MemoryStore())


def test_full_equals_the_familys_own_forward_and_generate(family, docs):
    engine = fresh(family)
    prompt = rag_prompt(docs)
    ids = prompt_ids(engine, prompt)
    windows = engine.runner.arch.windows
    assert not windows or len(ids) > 4 * max(windows)  # every windowed layer masks most of the prompt
    assert (engine.next_token_logits(prompt, "full") - engine.runner.reference_logits(ids)).abs().max() <= 1e-4
    x = torch.tensor([ids])
    hf = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=engine.tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert list(engine.generate(prompt, mode="full", max_new_tokens=8).token_ids) == hf


def test_exact_reuses_the_prefix_and_equals_full(family, docs):
    engine = fresh(family)
    engine.generate(rag_prompt(docs, question="First question?"), mode="exact", max_new_tokens=2)
    prompt = rag_prompt(docs, question="A different question entirely?")
    gen = engine.generate(prompt, mode="exact", max_new_tokens=12)
    assert gen.computed_tokens == len(engine.segmenter.segments(prompt)[-1])  # only the question
    assert gen.token_ids == engine.generate(prompt, mode="full", max_new_tokens=12).token_ids
    diff = engine.next_token_logits(prompt, "exact") - engine.next_token_logits(prompt, "full")
    assert diff.abs().max().item() <= 1e-4


def test_a_lone_chunk_first_in_modular_equals_full(family, docs):
    engine = fresh(family)
    prompt = [Chunk(docs[2]), Text("\n\nQuestion: what is it?")]
    engine.warm([docs[2]], progress=False)
    gen = engine.generate(prompt, mode="modular", max_new_tokens=1)
    assert gen.cached_tokens == len(engine.segmenter.ids(docs[2]))
    diff = engine.next_token_logits(prompt, "modular") - engine.next_token_logits(prompt, "full")
    assert diff.abs().max().item() <= 1e-4


def test_reordered_chunks_are_reused(family, docs):
    engine = fresh(family)
    engine.warm(docs[:3], progress=False)
    gen = engine.generate([Text("Q: "), Chunk(docs[2]), Chunk(docs[0]), Chunk(docs[1]), Text("\nA?")],
                          mode="modular", max_new_tokens=2)
    assert gen.cached_tokens >= 0.9 * gen.prompt_tokens
    assert torch.isfinite(engine.next_token_logits([Chunk(docs[1]), Chunk(docs[0]), Text("?")], "modular")).all()


def test_where_a_chunk_was_first_used_does_not_change_modular(family, docs):
    # Each engine first meets the chunk at another position (so its block is encoded, stored and relocated there
    # first), then answers the same prompt with the chunk at a third position: the same logits (<= 1e-3).
    prompt = [Text("Intro text that puts the chunk further along. "), Chunk(docs[1]), Text("\nQ?")]
    logits = []
    for intro in ("", "A much longer introduction, " * 12):
        engine = fresh(family)
        engine.generate([Text(intro + "Then: "), Chunk(docs[1]), Text("\nFirst?")], mode="modular", max_new_tokens=1)
        logits.append(engine.next_token_logits(prompt, "modular"))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-3


def test_blend_at_ratio_one_equals_full(family, docs):
    engine = fresh(family)
    engine.warm(docs[:2], progress=False)
    prompt = [Text("Sys. "), Chunk(docs[1]), Text("\n"), Chunk(docs[0]), Text("\nQ?")]
    full = engine.next_token_logits(prompt, "full")
    for selection in ("progressive", "deviation"):
        engine.blend_selection = selection
        blend = engine.next_token_logits(prompt, "blend", recompute_ratio=1.0)
        assert (blend - full).abs().max().item() <= 1e-4, selection


def test_ape_at_temperature_and_scale_one_is_modular(family, docs):
    # APE's own attention (pc_rag/model/aligned.py) over windows, soft-caps and mixed layer kinds, in the prompt's
    # forward and in decode steps: at T = S = 1 it is modular's attention (<= 1e-4, the same greedy tokens).
    engine = fresh(family)
    engine.ape = pc_rag.align.APE(1.0, 1.0)
    prompt = rag_prompt(docs, order=(2, 0, 1))
    modular = engine.next_token_logits(prompt, "modular")
    assert (engine.next_token_logits(prompt, "modular", align="ape") - modular).abs().max().item() <= 1e-4
    plain = engine.generate(prompt, mode="modular", max_new_tokens=4)
    assert engine.generate(prompt, mode="modular", align="ape", max_new_tokens=4).token_ids == plain.token_ids


def test_batched_decoding_equals_one_at_a_time(family, docs):
    # Prompts of 300 to 480 characters (80 to 120 tokens): every decode step reads past the windows.
    _check_decode_batch(fresh(family), docs, chars=300)


def test_a_step_with_newcomers_equals_each_ones_forward(family, docs):
    _check_forward_rows(fresh(family), docs, chars=300)


def test_a_disk_round_trip_equals_memory(family, docs, tmp_path):
    prompt = rag_prompt(docs, order=(1, 0))
    memory = fresh(family)
    memory.warm(docs[:2], progress=False)
    memory.generate(rag_prompt(docs, order=(1, 0), question="Earlier?"), mode="exact", max_new_tokens=1)
    writer = fresh(family, store=f"disk:{tmp_path}")
    writer.warm(docs[:2], progress=False)
    writer.generate(rag_prompt(docs, order=(1, 0), question="Earlier?"), mode="exact", max_new_tokens=1)
    reader = fresh(family, store=f"disk:{tmp_path}")  # nothing in memory: every block comes from the files
    for mode in ("modular", "exact"):
        got = reader.next_token_logits(prompt, mode)
        assert (got - memory.next_token_logits(prompt, mode)).abs().max().item() <= 1e-5, mode
    origins = {s.origin for s in reader.generate(prompt, mode="modular", max_new_tokens=1).sources if s.kind == "chunk"}
    assert origins <= {"disk", "memory"}


def test_the_relocation_self_check_passes_and_is_reported(family, docs):
    engine = fresh(family)
    engine.generate([Chunk(docs[0]), Text("?")], mode="modular", max_new_tokens=1)
    check = engine.stats()["relocation_check"]
    assert check["ok"] and check["error"] <= check["tolerance"] and check["ms"] > 0
    assert 0 <= check["layer"] < engine.runner.shape.num_layers and check["delta"] > 0
    # cached per model: another engine over the same weights reports it before its first modular request
    assert fresh(family).stats()["relocation_check"] == check


# ---- a wrong rotation is refused ---------------------------------------------------------------------------
def _wrong(rope, layer_table):
    """`rope` with the layers' tables replaced by `layer_table(run) -> table`."""
    runs = tuple(dataclasses.replace(run, table=layer_table(run)) for run in rope.runs)
    return dataclasses.replace(rope, runs=runs)


@pytest.mark.parametrize("how", ["base", "dims", "swapped", "nope"])
def test_a_wrong_rotation_is_refused_by_the_self_check(tmp_path, docs, how, record_property):
    family = {"base": "llama", "dims": "phi3", "swapped": "gemma3_text", "nope": "smollm3"}[how]
    engine = pc_rag.Engine.from_pretrained(build_tiny(tmp_path, family), store="memory")
    rope = engine.runner.rope
    tables = list(rope.tables.values())
    if how == "base":  # frequencies 5% off
        bad = dataclasses.replace(tables[0], inv_freq=tables[0].inv_freq * 1.05)
        engine.runner.rope = _wrong(rope, lambda run: bad)
    elif how == "dims":  # Phi-3's partial rotary ignored: every dim of the head rotated
        d = engine.runner.shape.head_dim
        full = 1.0 / (10_000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        engine.runner.rope = _wrong(rope, lambda run: dataclasses.replace(tables[0], inv_freq=full))
    elif how == "swapped":  # Gemma 3: local layers rotated with the global base and the other way round
        other = {"sliding_attention": rope.tables["full_attention"], "full_attention": rope.tables["sliding_attention"]}
        engine.runner.rope = _wrong(rope, lambda run: other[run.table.name])
    else:  # SmolLM3: its NoPE layer (1) rotated like the others; layer 0 is right
        engine.runner.rope = _wrong(rope, lambda run: tables[0])
    prompt = [Text("Intro. "), Chunk(docs[0]), Text("\nQ?")]
    first = 1 if how == "nope" else 0
    for mode in ("modular", "blend"):
        with pytest.raises(pc_rag.UnsupportedModelError, match=rf"\({family}\).* layer {first} .*'exact'"):
            engine.generate(prompt, mode=mode, max_new_tokens=1)
    check = engine.stats()["relocation_check"]
    record_property("wrong_rotation_error", check["error"])
    assert not check["ok"] and check["layer"] == first and check["error"] > 10 * check["tolerance"]
    with pytest.raises(pc_rag.UnsupportedModelError, match=rf"layer {first} "):  # explain refuses as requests do
        engine.explain(prompt, "modular")
    assert engine.explain(prompt, "exact").mode == "exact"
    full = engine.next_token_logits(prompt, "full")  # exact and full never relocate: they work
    assert (engine.next_token_logits(prompt, "exact") - full).abs().max().item() <= 1e-4
    # the right rotation of the same weights is checked on its own, and passes
    engine.runner.rope = rope
    engine.generate(prompt, mode="modular", max_new_tokens=1)
    assert engine.stats()["relocation_check"]["ok"]


def test_longrope_refuses_modular_but_runs_exact(tmp_path, docs):
    # Phi-3.5 / Phi-4-mini's longrope switches frequencies with the sequence length: never relocated.
    rope = {"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0] * 6, "long_factor": [2.0] * 6, "original_max_position_embeddings": 1024}
    engine = pc_rag.Engine.from_pretrained(build_tiny(tmp_path, "phi3", rope_parameters=rope), store="memory")
    _refuses_reuse_but_runs_exact(engine, docs, "longrope")


def test_m_rope_refuses_modular_but_runs_exact(tmp_path, docs):
    # M-RoPE (Qwen2-VL style) rotates sections of each head by positions of other modalities: never relocated. A
    # text-only Qwen2 given `mrope_section` computes plain RoPE in HF; pc_rag still refuses to relocate it.
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
    engine = pc_rag.Engine.from_pretrained(build_tiny(tmp_path, "qwen2", rope_parameters=rope), store="memory")
    assert engine.runner.rope_type == "mrope"
    _refuses_reuse_but_runs_exact(engine, docs, "mrope|M-RoPE")


def _refuses_reuse_but_runs_exact(engine, docs, reason):
    """modular, blend (and their explain) refused naming `reason`; full = HF's forward, exact = full (<= 1e-4)."""
    prompt = [Text("Intro. "), Chunk(docs[0]), Text("\nWhat?")]
    for mode in ("modular", "blend"):
        with pytest.raises(pc_rag.UnsupportedModelError, match=reason):
            engine.generate(prompt, mode=mode)
        with pytest.raises(pc_rag.UnsupportedModelError, match=reason):
            engine.explain(prompt, mode)
    engine.generate(prompt, mode="exact", max_new_tokens=2)
    full = engine.next_token_logits(prompt, "full")
    assert (full - engine.runner.reference_logits(prompt_ids(engine, prompt))).abs().max().item() <= 1e-4
    assert (engine.next_token_logits(prompt, "exact") - full).abs().max().item() <= 1e-4
    assert engine.stats()["relocation_check"] is None  # refused before any probe


def test_relocation_runs_follow_the_layers(tmp_path):
    # SmolLM3's NoPE layer and Gemma 3's local/global layers: one run per stretch of layers relocated alike.
    smol = pc_rag.Engine.from_pretrained(build_tiny(tmp_path / "s", "smollm3"), store="memory").runner.rope
    assert [(r.start, r.stop, r.table and r.table.name) for r in smol.runs] == [
        (0, 1, "default"), (1, 2, None), (2, 3, "default")]
    gemma = pc_rag.Engine.from_pretrained(build_tiny(tmp_path / "g", "gemma3_text"), store="memory").runner.rope
    assert [(r.start, r.stop, r.table.name) for r in gemma.runs] == [
        (0, 2, "sliding_attention"), (2, 3, "full_attention")]
    assert gemma.tables["full_attention"].rope_type == "linear"
    assert rope_module.RELOCATABLE_ROPE_TYPES == ("default", "linear", "llama3", "yarn")
