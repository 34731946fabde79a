"""The gate per model (`Engine.min_agreement`, pc_rag/quality.py `calibrate`).

Reference: for each built-in prompt, a fresh engine's own full and modular next-token logits (its chunks warmed
first, as the calibration encodes them): the calibration's agreement and KL must equal them (KL within 1e-3
relative; the calibration's full is blend at ratio 1, equal to full within float rounding). Then the reaction: a
bound above the measured agreement refuses modular (and only modular), one at or below it lets it run.
"""

import pytest
import torch

import pc_rag
from pc_rag.errors import UnsupportedModelError
from pc_rag.quality import calibrate, calibration_prompts
from pc_rag.store import MemoryStore


def test_calibration_matches_the_engine_in_full_and_modular(loaded):
    cal = calibrate(pc_rag.Engine(*loaded, store=MemoryStore()))
    prompts = calibration_prompts()
    assert len(cal.prompts) == len(prompts) == 8
    for measured, prompt in zip(cal.prompts, prompts, strict=True):
        engine = pc_rag.Engine(*loaded, store=MemoryStore())
        engine.warm([p for p in prompt if isinstance(p, pc_rag.Chunk)], progress=False)
        full = torch.log_softmax(engine.next_token_logits(prompt, mode="full").float(), -1)
        modular = torch.log_softmax(engine.next_token_logits(prompt, mode="modular").float(), -1)
        assert measured.agrees == (int(full.argmax()) == int(modular.argmax()))
        kl = float((full.exp() * (full - modular)).sum())
        assert kl > 1e-6  # chunks after other chunks: modular is not full here
        assert measured.kl == pytest.approx(kl, rel=1e-3, abs=1e-6)
        assert measured.deviation > 0
    assert cal.agreement == sum(p.agrees for p in cal.prompts) / 8


def test_a_bound_above_the_agreement_refuses_modular_only(loaded, docs):
    engine = pc_rag.Engine(*loaded, store=MemoryStore())
    prompt = [pc_rag.Text("Context:\n"), pc_rag.Chunk(docs[0]), pc_rag.Chunk(docs[1]), pc_rag.Text("Q: what?\nA:")]
    assert engine.stats()["quality_gate"] is None
    engine.generate(prompt, mode="modular", max_new_tokens=2)  # no bound: no calibration, nothing refused
    assert engine.calibration is None
    engine.min_agreement = 1.01  # above any agreement
    with pytest.raises(UnsupportedModelError, match=r"modular refused on this model: .* of 8 built-in prompts"):
        engine.generate(prompt, mode="modular", max_new_tokens=2)
    gate = engine.stats()["quality_gate"]
    assert gate["min_agreement"] == 1.01 and gate["prompts"] == 8 and 0.0 <= gate["agreement"] <= 1.0
    engine.generate(prompt, mode="blend", max_new_tokens=2)  # blend recomputes: allowed
    engine.generate(prompt, mode="exact", max_new_tokens=2)
    engine.min_agreement = gate["agreement"]  # at the measured agreement: allowed, without measuring again
    calibration = engine.calibration
    engine.generate(prompt, mode="modular", max_new_tokens=2)
    assert engine.calibration is calibration
