"""APE (pc_rag/align.py): attention over reused chunks with a temperature and a scale, on the offline tiny Llama.

References: modular's own logits (APE with T = S = 1 is modular: fp32, 1e-4), full's (no reused chunks, or blend
at ratio 1, leave nothing to align: 1e-4), and a hand-written attention with the temperature folded into the keys
and the scale as an additive mask through sdpa (1e-5)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pc_rag
from pc_rag import Chunk, Text, quality
from pc_rag.align import APE
from pc_rag.model.aligned import Aligned, attend
from pc_rag.options import GenerationOptions
from pc_rag.request import prefill
from pc_rag.store import DiskStore, MemoryStore

from .test_engine import rag_prompt


def _logits(engine, prompt, mode="modular", **kw):
    return engine.next_token_logits(prompt, mode, **kw)


def test_ape_at_temperature_and_scale_one_is_modular(engine, docs):
    prompt = rag_prompt(docs, order=(2, 0, 1))
    modular = _logits(engine, prompt)
    engine.ape = APE(1.0, 1.0)
    assert (_logits(engine, prompt, align="ape") - modular).abs().max().item() <= 1e-4
    blend = _logits(engine, prompt, "blend", recompute_ratio=0.2)
    assert (_logits(engine, prompt, "blend", recompute_ratio=0.2, align="ape") - blend).abs().max().item() <= 1e-4


def test_ape_changes_modular_and_leaves_the_stored_blocks_as_they_were(engine, docs):
    prompt = rag_prompt(docs, order=(2, 0, 1))
    modular = _logits(engine, prompt)
    plan = engine.explain(prompt).plan
    stored = {p.key: engine.store.get(p.key) for p in plan.pieces if p.relocated}
    before = {k: (b.keys.clone(), b.values.clone()) for k, b in stored.items()}
    engine.ape = APE(0.7, 1.5)
    ape = _logits(engine, prompt, align="ape")
    assert (ape - modular).abs().max().item() > 1e-3  # it does something
    for key, (k, v) in before.items():
        block = engine.store.get(key)
        assert torch.equal(block.keys, k) and torch.equal(block.values, v)
    # and modular after an APE request is modular: the question's APE KV is never stored as a prefix block
    assert (_logits(engine, prompt) - modular).abs().max().item() <= 1e-5


def test_ape_without_reused_chunks_equals_full(engine, docs):
    prompt = [Text(docs[0][:200]), Text("\n\nQuestion: what is it?")]
    engine.ape = APE(0.7, 1.5)
    full = _logits(engine, prompt, "full")
    assert (_logits(engine, prompt, align="ape") - full).abs().max().item() <= 1e-4


def test_blend_at_ratio_one_with_ape_equals_full(engine, docs):
    # every chunk token recomputed in every layer: no cached KV left to align
    prompt = rag_prompt(docs, order=(1, 2, 0))
    engine.ape = APE(0.7, 1.5)
    full = _logits(engine, prompt, "full")
    got = _logits(engine, prompt, "blend", recompute_ratio=1.0, align="ape")
    assert (got - full).abs().max().item() <= 1e-4


def _reference(q, k, v, rows, scaling, group, aligned_keys, reused, ape):
    """APE by another route: per query row, the temperature folded into the aligned keys (k / T) and log S as an
    additive float mask, through sdpa."""
    out = []
    for r, slot in enumerate(rows.tolist()):
        keys = k[:, :, : slot + 1].clone()
        bias = torch.zeros(slot + 1)
        if not reused[slot]:
            on = aligned_keys[: slot + 1]
            keys[:, :, on] = keys[:, :, on] / ape.temperature
            bias[on] = math.log(ape.scale)
        keys = keys.repeat_interleave(group, 1)
        values = v[:, :, : slot + 1].repeat_interleave(group, 1)
        out.append(F.scaled_dot_product_attention(q[:, :, r: r + 1], keys, values, attn_mask=bias[None, None, None],
                                                  scale=scaling))
    return torch.cat(out, 2)


def test_ape_attention_equals_a_reference_with_folded_temperature_and_an_additive_mask():
    torch.manual_seed(0)
    h_kv, group, d, t = 2, 3, 16, 40
    keys, values = torch.randn(1, h_kv, t, d), torch.randn(1, h_kv, t, d)
    rows = torch.tensor([5, 12, 30, 31, 39])  # a reused slot among them (12): never aligned as a query
    q = torch.randn(1, h_kv * group, len(rows), d)
    ape = APE(0.7, 1.8)
    aligned = Aligned.of(ape, [*range(3, 10), *range(12, 25)], t, 2, "cpu")
    aligned.computed(1, torch.tensor([20, 21]))  # recomputed by blend in layer 1: fresh there
    for layer in (0, 1):
        got = attend(q, keys, values, rows, 0.25, group, None, None, aligned, layer)
        want = _reference(q, keys, values, rows, 0.25, group, aligned.mask[layer], aligned.reused, ape)
        assert (got - want).abs().max().item() <= 1e-5
    plain = attend(q, keys, values, rows, 0.25, group, None, None, Aligned.of(APE(1.0, 1.0), [3, 4], t, 1, "cpu"), 0)
    none = torch.zeros(t, dtype=torch.bool)
    want = _reference(q, keys, values, rows, 0.25, group, none, none, ape)
    assert (plain - want).abs().max().item() <= 1e-5


def test_ape_decode_step_equals_its_forward_alone_and_in_a_batch(engine, docs):
    """A decode step of an APE request (the unfused step, beside a plain request too) equals the one-token forward
    through the prefill path, 1e-5."""
    engine.ape = APE(0.8, 1.2)
    prompt = rag_prompt(docs, order=(0, 2, 1))
    runner = engine.runner
    with engine.traffic.counted():
        asm = prefill(engine, prompt, GenerationOptions(mode="modular", align="ape"), extra_capacity=4)
        plain = prefill(engine, rag_prompt(docs, order=(1, 0, 2)), GenerationOptions(mode="modular"),
                        extra_capacity=4)
        try:
            assert asm.cache.align is not None and plain.cache.align is None
            n, m = asm.prompt_tokens, plain.prompt_tokens
            copy = runner.copy_cache(asm.cache, n)
            token = int(asm.logits.argmax())
            forward = runner.forward_layers(copy, [token], [asm.last_position + 1], [n])
            alone = runner.decode_batch([asm.cache], [token], [asm.last_position + 1], [n])[0]
            assert (alone - forward).abs().max().item() <= 1e-5
            batch = runner.decode_batch([asm.cache, plain.cache], [token, token],
                                        [asm.last_position + 1, plain.last_position + 1], [n, m])
            assert (batch[0] - forward).abs().max().item() <= 1e-5
            runner.release_cache(copy)
        finally:
            runner.release_cache(asm.cache)
            runner.release_cache(plain.cache)
    assert asm.cache.align is None  # a buffer back in the pool holds no request's alignment


def test_ape_generates_what_its_greedy_steps_choose(engine, docs):
    engine.ape = APE(0.8, 1.2)
    prompt = rag_prompt(docs, order=(0, 2, 1))
    gen = engine.generate(prompt, mode="modular", align="ape", max_new_tokens=4)
    again = engine.generate(prompt, mode="modular", align="ape", max_new_tokens=4)
    assert gen.token_ids == again.token_ids and len(gen.token_ids) == 4
    assert gen.token_ids[0] == int(_logits(engine, prompt, align="ape").argmax())


@pytest.mark.parametrize("kw, named", [
    ({"align": "apex"}, "align"),
    ({"align": 1}, "align"),
    ({"align": "ape", "mode": "full"}, "align"),
    ({"align": "ape", "mode": "exact"}, "align"),
])
def test_align_option_is_checked(kw, named):
    with pytest.raises(pc_rag.OptionError, match=named):
        GenerationOptions(**kw)


@pytest.mark.parametrize("t, s", [(0.0, 1.0), (1.5, 1.0), (float("nan"), 1.0), (0.9, 0.0), (0.9, -1.0), ("0.9", 1.0)])
def test_ape_pair_is_checked(t, s):
    with pytest.raises(pc_rag.OptionError, match="temperature|scale"):
        APE(t, s)


def test_generate_refuses_a_bad_align_at_the_call(engine, docs):
    with pytest.raises(pc_rag.OptionError, match="align"):
        engine.stream(rag_prompt(docs), mode="full", align="ape")


def test_explain_shows_ape(engine, docs):
    engine.ape = APE(0.8, 1.2)
    prompt = rag_prompt(docs)
    shown = engine.explain(prompt, align="ape")
    assert shown.plan.align == APE(0.8, 1.2)
    assert "APE" in str(shown) and "temperature 0.8" in str(shown) and "scale 1.2" in str(shown)
    assert engine.explain(prompt).plan.align is None and "APE" not in str(engine.explain(prompt))
    alone = engine.explain([Text("no chunks here at all")], align="ape")
    assert "nothing to align" in str(alone)
    with pytest.raises(pc_rag.OptionError, match="align"):
        engine.explain(prompt, mode="exact", align="ape")


def test_calibration_picks_the_pair_closest_to_full_and_the_engine_uses_it(engine, docs, monkeypatch):
    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})  # this test's calibration stays in this test
    prompts = [rag_prompt(docs, order=o) for o in ((0, 1, 2), (2, 0, 1))]
    ape, table = engine.calibrate_ape(prompts, temperatures=(1.0, 0.8), scales=(1.0, 1.5))
    assert set(table) == {(1.0, 1.0), (1.0, 1.5), (0.8, 1.0), (0.8, 1.5)}
    best = min(table.values(), key=lambda m: m["kl"])
    plain = table[(1.0, 1.0)]
    earned = best["kl"] <= (1 - quality.APE_MIN_KL_GAIN) * plain["kl"] and best["agreement"] >= plain["agreement"]
    assert table[(ape.temperature, ape.scale)] == (best if earned else plain)
    assert engine.ape == ape
    other = pc_rag.Engine(engine.model, engine.tokenizer, store=pc_rag.store.MemoryStore())
    assert pc_rag.align.ape_for(other) == ape  # remembered for the model's fingerprint in this process
    assert engine.store.tier_stats()[0].entries == 0  # measured in a store of its own


def test_calibration_keeps_modular_when_no_pair_earns_its_place(engine, docs, monkeypatch):
    """A pair whose KL is not APE_MIN_KL_GAIN below modular's is not taken: a scale of 1.001 moves the KL by far
    less than that, so calibration returns T = S = 1 (modular), which is measured even when the grid lacks it."""
    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})
    prompts = [rag_prompt(docs, order=o) for o in ((0, 1, 2), (2, 0, 1))]
    ape, table = engine.calibrate_ape(prompts, temperatures=(1.0,), scales=(1.001,))
    assert set(table) == {(1.0, 1.0), (1.0, 1.001)}
    assert abs(table[(1.0, 1.001)]["kl"] - table[(1.0, 1.0)]["kl"]) < quality.APE_MIN_KL_GAIN * table[(1.0, 1.0)]["kl"]
    assert (ape.temperature, ape.scale) == (1.0, 1.0) and engine.ape == ape


def test_a_chunk_prompt_reuses_bos_once(engine, docs):
    """APE's shared prefix: every chunk is encoded after the same BOS, whose KV the prompt holds once at slot 0;
    the chunk blocks hold their own tokens only."""
    prompt = [Chunk(docs[0]), Text("\n\n"), Chunk(docs[1]), Text("\n\nQuestion: what?")]
    plan = engine.explain(prompt).plan
    bos = engine.planner.sink_ids
    assert bos and plan.ids[: len(bos)] == bos
    chunk_slots = [s for p in plan.pieces if p.relocated for s in range(p.slot, p.slot + p.n)]
    assert all(plan.ids[s] not in bos for s in chunk_slots)
    assert min(chunk_slots) == len(bos)


def test_check_settings_with_ape():
    from pc_rag.check import Setting

    assert Setting.parse("ape") == Setting("modular", align="ape") == Setting.parse("modular:ape")
    assert Setting.parse("ape").name == "modular ape"
    assert Setting.parse("blend:0.1:chunk_start:ape") == Setting("blend", 0.1, "chunk_start", align="ape")
    assert Setting.parse("auto:0.8:ape").name == "auto 0.8 ape"
    for bad in ("exact:ape", "ape:ape", "blend:0.2:ape:x"):
        with pytest.raises(pc_rag.PCRagError, match="check: "):
            Setting.parse(bad)


def test_check_reports_ape_and_at_one_one_it_is_modular(loaded, docs):
    """pc-rag check's APE row: with T = S = 1, modular's answers and KL (float noise)."""
    from pc_rag.check import rag_prompt as check_prompt
    from pc_rag.store import MemoryStore

    engine = pc_rag.Engine(*loaded, store=MemoryStore())
    engine.ape = APE(1.0, 1.0)
    prompts = [check_prompt([docs[0], docs[1], docs[2]], "What does the first one say?", "Answer.\n\n"),
               check_prompt([docs[2], docs[0], docs[3]], "And the third?", "Answer.\n\n")]
    report = engine.check(prompts, modes=["modular", "ape"], max_new_tokens=4, progress=False)
    ape, modular = report.mode("modular ape"), report.mode("modular")
    assert ape.align == "ape" and modular.align is None
    assert ape.identical == modular.identical
    assert ape.kl_mean == pytest.approx(modular.kl_mean, rel=1e-3, abs=1e-6)


def test_explain_command_shows_ape(tiny_path, docs, tmp_path, capsys):
    import json

    from pc_rag import cli
    from pc_rag.align import DEFAULT

    cache = ["--cache-dir", str(tmp_path / "cache")]
    prompt = "Context:\n" + docs[0] + "\n\nQuestion: what does it say?"
    args = ["explain", prompt, "--chunk", docs[0], "--model", str(tiny_path), *cache]
    assert cli.main([*args, "--align", "ape", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ape"] == DEFAULT.as_dict()
    assert cli.main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ape"] is None
    assert cli.main([*args, "--align", "ape", "--mode", "exact"]) != 0
    assert "align" in capsys.readouterr().err


def test_server_takes_align_and_refuses_a_bad_one(loaded, docs):
    """`align` is one of the server's extensions: "ape" with modular runs (200), an unknown value or "ape" with a mode
    that reuses no chunk is a 400 naming it."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from pc_rag.serve.app import ServerSettings, create_app
    from pc_rag.store import MemoryStore

    engine = pc_rag.Engine(*loaded, store=MemoryStore())
    body = {"model": "m", "max_tokens": 4, "temperature": 0, "chunks": [docs[0]],
            "prompt": "Context:\n" + docs[0] + "\n\nQuestion: what does it say?\nAnswer:"}
    with TestClient(create_app(engine, ServerSettings("tiny"))) as http:
        ok = http.post("/v1/completions", json={**body, "mode": "modular", "align": "ape"})
        assert ok.status_code == 200, ok.text
        for bad in ({"mode": "modular", "align": "apex"}, {"mode": "exact", "align": "ape"}):
            refused = http.post("/v1/completions", json={**body, **bad})
            assert refused.status_code == 400 and "align" in refused.text, refused.text


def test_blends_recomputed_rows_through_the_kernels_equal_ape_attention_over_every_row(engine, docs, monkeypatch):
    """Blend with APE sends its recomputed chunk rows (no APE for them) through the runner's kernels and the rest
    through APE's attention; the reference runs every row through APE's attention (1e-4, fp32)."""
    from pc_rag.model import attention

    engine.ape = APE(0.7, 1.5)
    prompt = rag_prompt(docs, order=(1, 2, 0))
    split = _logits(engine, prompt, "blend", recompute_ratio=0.2, align="ape")

    def every_row(layer_keys, layer_values, heads, window, q, w, backends, aligned, layer):
        return attend(q, layer_keys[:, :, : w.kv], layer_values[:, :, : w.kv], w.rows(q.device), heads.scaling,
                      heads.num_key_value_groups, window, heads.softcap, aligned, layer)

    monkeypatch.setattr(attention, "_attend_with_ape", every_row)
    whole = _logits(engine, prompt, "blend", recompute_ratio=0.2, align="ape")
    assert (split - whole).abs().max().item() <= 1e-4
    assert (split - _logits(engine, prompt, "blend", recompute_ratio=0.2)).abs().max().item() > 1e-3


def test_a_calibration_is_saved_in_the_cache_folder_and_a_later_engine_uses_it(loaded, docs, tmp_path, monkeypatch):
    """Calibrate once, restart (this process's memory of it cleared), and an engine over the same disk folder
    answers align="ape" with the saved pair: its logits equal those of that pair set by hand (1e-5)."""
    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})
    model, tok = loaded
    first = pc_rag.Engine(model, tok, store=["memory", f"disk:{tmp_path}"])
    assert first.calibration_dir == tmp_path
    prompts = [rag_prompt(docs, order=o) for o in ((0, 1, 2), (2, 0, 1))]
    ape, table = first.calibrate_ape(prompts, temperatures=(1.0, 0.6), scales=(1.0, 0.3, 2.0))
    path = pc_rag.align.calibration_file(tmp_path, first.planner.fingerprint)
    saved = json.loads(path.read_text())
    assert (saved["temperature"], saved["scale"]) == (ape.temperature, ape.scale)
    assert saved["fingerprint"] == first.planner.fingerprint and saved["prompts"] == 2
    assert {(m["temperature"], m["scale"]) for m in saved["measured"]} == set(table)

    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})  # a new process
    later = pc_rag.Engine(model, tok, store=DiskStore(tmp_path))
    assert pc_rag.align.ape_for(later) == ape and later.explain(prompts[0], align="ape").plan.align == ape
    by_hand = pc_rag.Engine(model, tok, store=MemoryStore())
    by_hand.ape = ape
    prompt = rag_prompt(docs, order=(1, 2, 0))
    got = _logits(later, prompt, align="ape")
    assert (got - _logits(by_hand, prompt, align="ape")).abs().max().item() <= 1e-5

    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})
    elsewhere = pc_rag.Engine(model, tok, store=MemoryStore())  # no disk folder: nothing to find
    assert elsewhere.calibration_dir is None and pc_rag.align.ape_for(elsewhere) == pc_rag.align.DEFAULT


def test_a_damaged_or_foreign_calibration_is_ignored_with_a_warning(loaded, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})
    model, tok = loaded
    fingerprint = pc_rag.Engine(model, tok, store=MemoryStore()).planner.fingerprint
    path = pc_rag.align.calibration_file(tmp_path, fingerprint)
    path.parent.mkdir(parents=True)
    good = {"fingerprint": fingerprint, "temperature": 0.7, "scale": 0.5}
    for damaged in ("{not json", json.dumps([1, 2]), json.dumps({**good, "fingerprint": "another model"}),
                    json.dumps({**good, "temperature": 3.0}), json.dumps({**good, "scale": "big"}),
                    json.dumps({"fingerprint": fingerprint})):
        path.write_text(damaged)
        caplog.clear()
        with caplog.at_level("WARNING", logger="pc_rag.align"):
            engine = pc_rag.Engine(model, tok, store=DiskStore(tmp_path))
        assert pc_rag.align.ape_for(engine) == pc_rag.align.DEFAULT, damaged
        assert "ignoring the APE calibration" in caplog.text and str(path) in caplog.text
    path.write_text(json.dumps(good))
    assert pc_rag.align.ape_for(pc_rag.Engine(model, tok, store=DiskStore(tmp_path))) == APE(0.7, 0.5)


def test_check_calibrates_ape_once_and_explain_then_uses_the_pair(tiny_path, docs, tmp_path, capsys, monkeypatch):
    from pc_rag import cli

    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})
    lines = [json.dumps({"documents": [docs[0], docs[1], docs[2]], "question": "Why?"}),
             json.dumps({"documents": [docs[2], docs[0]], "question": "How?"})]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert cli.main(["check", "--model", str(tiny_path), "--prompts", str(tmp_path / "prompts.jsonl"), "--modes",
                     "modular", "--max-new-tokens", "2", "--calibrate-ape", "--json", *cache]) == 0
    out = json.loads(capsys.readouterr().out)
    cal = out["ape_calibration"]
    assert set(out["modes"]) == {"modular", "modular ape"} and cal["prompts"] == 2
    assert Path(cal["saved"]).is_file() and cal["kl"] <= cal["modular_kl"]
    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})  # a new process
    assert cli.main(["explain", "facts", "--align", "ape", "--json", "--model", str(tiny_path), *cache]) == 0
    assert json.loads(capsys.readouterr().out)["ape"] == {"temperature": cal["temperature"], "scale": cal["scale"]}
    assert cli.main(["stats", "--json", *cache]) == 0
    assert json.loads(capsys.readouterr().out)["ape_calibrations"] == 1
    assert cli.main(["clear", "--all", *cache]) == 0
    assert not Path(cal["saved"]).exists()


def test_a_calibration_that_cannot_be_saved_still_holds_for_the_process(engine, docs, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(pc_rag.align, "CALIBRATED", {})
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    engine.calibration_dir = blocked
    prompts = [rag_prompt(docs, order=(0, 1, 2))]
    with caplog.at_level("WARNING", logger="pc_rag.quality"):
        ape, _ = engine.calibrate_ape(prompts, temperatures=(1.0, 0.6), scales=(1.0, 0.3))
    assert "not saved" in caplog.text and str(blocked) in caplog.text
    assert engine.ape == ape and pc_rag.align.ape_for(engine) == ape
