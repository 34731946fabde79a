"""`pc-rag check` and pc_rag.check: each mode against full, on the tiny model.

References: exact equals full (agreement 1, KL within float noise); the check's per-prompt KL against the same KL
computed from the engine's own `full` next-token logits after each prefix of full's answer (so the reference
forward it uses is checked against full too); its identical/diverging verdicts against real greedy generations in
the mode; the JSON shape of the command; and the command's one-line errors.
"""

import json

import pytest
import torch

from pc_rag import cli
from pc_rag.check import Setting, check, rag_prompt
from pc_rag.errors import PCRagError

SYSTEM = "Answer from the documents below.\n\n"


@pytest.fixture(scope="module")
def prompts(docs):
    """Documents reused in other orders: two list-of-segment prompts and two plain strings (passages)."""
    return [rag_prompt([docs[0], docs[1], docs[2]], "What does the first one say?", SYSTEM),
            rag_prompt([docs[2], docs[0], docs[3]], "And the third?", SYSTEM),
            rag_prompt([docs[3], docs[1]], "Which one is longer?", SYSTEM, plain=True),
            rag_prompt([docs[1], docs[3], docs[0]], "What is common to them?", SYSTEM, plain=True)]


@pytest.fixture(scope="module")
def report(loaded, prompts):
    import pc_rag
    from pc_rag.store import MemoryStore

    engine = pc_rag.Engine(*loaded, store=MemoryStore())
    return check(engine, prompts, modes=["exact", "modular", "blend:1.0:chunk_start"], max_new_tokens=6)


def test_exact_agrees_with_full_and_modular_does_not(report, prompts):
    exact, modular = report.mode("exact"), report.mode("modular")
    assert report.prompts == len(prompts) and report.reference_mismatches == 0
    assert exact.agreement == 1.0 and exact.identical == len(prompts) and exact.first_divergence_mean is None
    assert abs(exact.kl_mean) < 1e-5 and exact.kl_max < 1e-4
    # Documents seen before in another order: modular reuses them (chunks and passages both) and is not full.
    assert modular.reused_tokens_mean > 100
    assert all(report.per_prompt[i]["modes"]["modular"]["kl_mean"] > 1e-5 for i in range(len(prompts)))
    assert modular.agreement < 1.0 or modular.kl_mean > 1e-4
    # recomputing every reused token is a full prefill
    whole = report.mode("blend 1 chunk_start")
    assert whole.agreement == 1.0 and abs(whole.kl_mean) < 1e-4 and whole.recomputed_tokens_mean > 100
    assert report.cheapest in ("exact", "blend 1 chunk_start")
    assert 0.0 <= modular.agreement_interval[0] <= modular.agreement <= modular.agreement_interval[1] <= 1.0
    text = str(report)
    assert "cannot tell" in text and "modular" in text and "Cheapest within agreement >= 0.9" in text


def test_kl_and_verdicts_against_the_engine_in_each_mode(loaded, prompts, report):
    """Reference: the engine's own full and modular next-token logits after each prefix of full's answer, and
    modular's greedy generation."""
    import pc_rag
    from pc_rag.segments import Text
    from pc_rag.store import MemoryStore

    engine = pc_rag.Engine(*loaded, store=MemoryStore())
    # Documents warm, as the check warms them: chunks encoded, passages sent once on their own.
    engine.warm([s for p in prompts if not isinstance(p, str) for s in p if isinstance(s, pc_rag.Chunk)],
                progress=False)
    passages = {s.token_ids: s for p in prompts if isinstance(p, str) for s in engine.split(p) if s.passage}
    assert len(passages) >= 2
    engine.next_token_logits(list(passages.values()), mode="modular")
    for i in (0, 2):  # a list of segments and a plain string
        p = prompts[i]
        full = engine.generate(p, mode="full", max_new_tokens=6)
        answer = list(full.token_ids)
        assert full.text == report.per_prompt[i]["full_answer"]
        segments = engine.split(p) if isinstance(p, str) else p
        kls = []
        for j in range(len(answer) + (full.finish_reason == "stop")):
            forced = segments + [Text("x", token_ids=tuple(answer[:j]))] if j else segments
            ref = torch.log_softmax(engine.next_token_logits(forced, mode="full").float(), -1)
            got = torch.log_softmax(engine.next_token_logits(forced, mode="modular").float(), -1)
            kls.append(float(torch.sum(ref.exp() * (ref - got))))
        expected = sum(kls) / len(kls)
        assert report.per_prompt[i]["modes"]["modular"]["kl_mean"] == pytest.approx(expected, rel=1e-2, abs=1e-5)
        greedy = list(engine.generate(p, mode="modular", max_new_tokens=6).token_ids)
        diverged = report.per_prompt[i]["modes"]["modular"]["first_divergence"]
        if diverged is None:
            assert greedy == answer
        else:
            assert greedy[:diverged] == answer[:diverged] and greedy[diverged:diverged + 1] != answer[diverged:][:1]


def test_settings_parse_and_refuse():
    assert Setting.parse("modular") == Setting("modular")
    assert Setting.parse("blend").name == "blend 0.2 progressive"
    assert Setting.parse("blend:0.15:chunk_start") == Setting("blend", 0.15, "chunk_start")
    assert Setting.parse("auto") == Setting("blend", None, "progressive", 0.9)
    assert Setting.parse("auto:0.5").name == "auto 0.5"
    for bad in ("full", "sideways", "blend:2", "blend:0.2:nearest", "modular:0.2", "auto:1.5", "auto:x"):
        with pytest.raises(PCRagError, match="check: "):
            Setting.parse(bad)


def test_bad_arguments_raise_before_any_work(engine, prompts):
    for kwargs, words in (({"modes": []}, "no modes"), ({"modes": ["modular", "modular"]}, "twice"),
                          ({"target": 1.5}, "target"), ({"max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(PCRagError, match=words):
            check(engine, prompts, **kwargs)
    for bad, words in (([], "no prompts"), ("one string", "list of prompts"), ([""], "prompt 0 is empty"),
                       ([[1, 2]], "prompt 0 is neither")):
        with pytest.raises(PCRagError, match=words):
            check(engine, bad)


def test_command_prints_json_per_mode(tiny_path, docs, tmp_path, capsys):
    lines = [json.dumps({"system": SYSTEM, "documents": [docs[0], docs[1]], "question": "Why?"}),
             json.dumps({"documents": [docs[1], docs[0]], "question": "How?"}),
             json.dumps(SYSTEM + docs[2] + "\n\n" + docs[0] + "\n\nQuestion: What?\nAnswer:")]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    assert cli.main(["check", "--model", str(tiny_path), "--prompts", str(tmp_path / "prompts.jsonl"), "--modes",
                     "exact", "modular", "blend:0.2:chunk_start", "--max-new-tokens", "3", "--json",
                     "--cache-dir", str(tmp_path / "cache")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompts"] == 3 and out["random_weights"] is True
    assert set(out["modes"]) == {"exact", "modular", "blend 0.2 chunk_start"}
    for m in out["modes"].values():
        assert 0.0 <= m["agreement"] <= 1.0 and m["ttft_median_s"] > 0 and m["prompts"] == 3
    assert out["modes"]["exact"]["agreement"] == 1.0
    assert out["cheapest"] in out["modes"] and "cannot_tell" in out
    assert not (tmp_path / "cache" / "pc_rag-kv-v1").exists()  # the check's store is memory unless asked


def test_command_retrieves_from_docs(tiny_path, seeded_embeddings, tmp_path, capsys):
    import shutil
    from pydoc_data.topics import topics

    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("for", "while", "try"):
        (folder / f"{name}.md").write_text(topics[name])
    (tmp_path / "q.txt").write_text("How do loops end?\n\nWhat does finally do?\n")
    shutil.copytree(seeded_embeddings, tmp_path / "cache" / "embeddings")
    assert cli.main(["check", "--model", str(tiny_path), "--docs", str(folder), "--questions", str(tmp_path / "q.txt"),
                     "--modes", "modular", "-k", "2", "--max-new-tokens", "2", "--plain",
                     "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "2 prompts" in out and "modular" in out and "What this cannot tell" in out


@pytest.mark.parametrize("args, words", [
    (["--docs", "/no/such/folder", "--questions", "{q}"], "/no/such/folder: no such file or folder"),
    (["--docs", "{docs}", "--questions", "{empty}"], "no questions in it"),
    (["--docs", "{docs}", "--questions", "{q}", "--modes", "modular", "sideways"], "unknown mode 'sideways'"),
    (["--docs", "{docs}"], "give --questions FILE"),
    (["--prompts", "{bad}"], ":2: not JSON"),
    (["--prompts", "{q}", "--questions", "{q}"], "give it alone"),
    (["--docs", "{docs}", "--questions", "{q}", "--target", "90"], "--target"),
])
def test_command_errors_are_one_line(args, words, tmp_path, capsys, monkeypatch):
    import pc_rag

    def must_not_load(*a, **k):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(pc_rag.Engine, "from_pretrained", must_not_load)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("A document about loops.")
    (tmp_path / "q.txt").write_text("Why?\n")
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('"fine"\n{not json\n')
    paths = {"q": tmp_path / "q.txt", "empty": tmp_path / "empty.txt", "docs": tmp_path / "docs",
             "bad": tmp_path / "bad.jsonl"}
    argv = ["check", *[a.format(**paths) for a in args], "--model", str(tmp_path / "docs"),
            "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_engine_check_with_quality_targets(loaded, prompts):
    """Engine.check runs pc_rag.check; blend with target 1 recomputes every reused token (= full: agreement 1, KL
    within float noise), target 0 recomputes none (modular's answers and KL, to float noise)."""
    import pc_rag
    from pc_rag.store import MemoryStore

    engine = pc_rag.Engine(*loaded, store=MemoryStore())
    report = engine.check(prompts, modes=["modular", "auto:1", "auto:0"], max_new_tokens=6, progress=False)
    whole, none, modular = report.mode("auto 1"), report.mode("auto 0"), report.mode("modular")
    assert whole.recompute_target == 1.0 and whole.recomputed_tokens_mean > 100
    assert whole.agreement == 1.0 and abs(whole.kl_mean) < 1e-4
    assert none.recomputed_tokens_mean == 0 and none.identical == modular.identical
    assert none.kl_mean == pytest.approx(modular.kl_mean, rel=1e-3, abs=1e-6)
