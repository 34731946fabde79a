"""The benchmark scripts' own claims, checked small: exact == full on the trained model, blend's end points,
that training is reproducible bit for bit (the committed checkpoint relies on it), and the GPU check's checks
on the CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pc_rag
from benchmarks import accuracy, train_retrieval
from benchmarks.retrieval_task import make_example, names, values

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "benchmarks" / "retrieval-model"
DEEP = REPO / "benchmarks" / "deep-retrieval-model"
LONG = REPO / "benchmarks" / "long-retrieval-model"


@pytest.fixture(scope="module")
def engine():
    return pc_rag.Engine.from_pretrained(MODEL, store="memory")


def test_accuracy_answers_exact_equals_full_and_blend_end_points(engine):
    rng = random.Random(3)
    name_list, value_list = names(), values()
    blends = ["1.0:chunk_start", "1.0:deviation", "0.0:deviation"]
    for task in ("single", "two_hop"):
        for _ in range(4):
            ex = make_example(rng, task, 4, name_list, value_list)
            got = accuracy.answers(engine, ex, blends)
            assert got["exact"] == got["full"], ex
            # recomputing every reused token is a full prefill; recomputing none is modular
            assert got["blend 1 chunk_start"] == got["full"] == got["blend 1 deviation"], ex
            assert got["blend 0 deviation"] == got["modular"], ex


@pytest.mark.parametrize("model", [DEEP, LONG], ids=["deep", "long"])
def test_deep_model_exact_equals_full_blend_end_points_and_a_lone_chunk_first(model):
    """The 8-layer testbeds (grown, GQA 8/4; the long one's chunks 64-256 tokens of prose around each fact): the
    same end points as the 4-layer model, on their three tasks."""
    from benchmarks.retrieval_task import chunk_tokens_of, in_prose

    engine = pc_rag.Engine.from_pretrained(model, store="memory")
    assert engine.runner.shape.num_layers == 8
    lengths = chunk_tokens_of(model)
    assert (lengths is not None) == (model == LONG)
    rng = random.Random(4)
    for task in ("single", "two_hop", "alias"):
        for _ in range(3):
            ex = make_example(rng, task, 4, names(), values())
            ex = in_prose(rng, ex, *lengths) if lengths else ex
            got = accuracy.answers(engine, ex, ["1.0:chunk_start", "0.0:deviation"])
            assert got["exact"] == got["full"] == got["blend 1 chunk_start"], ex
            assert got["blend 0 deviation"] == got["modular"], ex
        # a lone chunk first (right after BOS) is where it was encoded: modular is a full prefill
        prompt = [pc_rag.Chunk(ex.chunks[0]), pc_rag.Text(";"), pc_rag.Text(ex.question)]
        full = engine.next_token_logits(prompt, mode="full")
        assert torch.allclose(engine.next_token_logits(prompt, mode="modular"), full, atol=1e-4 * full.abs().max())


def test_accuracy_rejects_a_bad_blend_setting():
    with pytest.raises(SystemExit, match="0.3:sideways"):
        accuracy.parse_blend("0.3:sideways")
    with pytest.raises(SystemExit, match="0.8:deviation"):
        accuracy.parse_auto("0.8:deviation")
    assert [accuracy.auto_name(s) for s in (0.8, "0.9", "0.9:shift")] == ["auto 0.8", "auto 0.9", "auto 0.9 shift"]


def test_accuracy_targets_read_from_either_probe_span_modular_to_full(engine):
    # A target of 0 is modular, 1 is full (every deviating token recomputed), read from layer 1 or the cheap probe,
    # within 1e-4 of the largest log-probability (fp32). The first chunk sits where it was encoded, right after BOS:
    # the cheap probe finds it unmoved (0) and keeps its cached KV, which a full prefill computes over other shapes.
    rng = random.Random(5)
    for _ in range(3):
        ex = make_example(rng, "two_hop", 4, names(), values())
        logps = accuracy.answer_logprobs(engine, ex, [], targets=["0", "1", "0:shift", "1:shift"])
        tol = 1e-4 * logps["full"].abs().max().item()
        for probe in ("", " shift"):
            assert torch.allclose(logps[f"auto 0{probe}"], logps["modular"], atol=tol), probe
            assert torch.allclose(logps[f"auto 1{probe}"], logps["full"], atol=tol), probe
    assert engine.blend_selection == "progressive"  # put back


def test_training_is_reproducible(tmp_path):
    args = ["--layers", "1", "--hidden", "32", "--intermediate", "64", "--batch", "8", "--max-steps", "3",
            "--eval-every", "3", "--eval-n", "4", "--max-chunks", "3"]
    for run in ("a", "b"):
        train_retrieval.main([*args, "--out", str(tmp_path / run)])
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # a longer run stopped at the same step (no decay: the same schedule) is the same run
    train_retrieval.main([*args, "--out", str(tmp_path / "d"), "--max-steps", "6", "--until-step", "3"])
    d = load_file(tmp_path / "d" / "model.safetensors")
    assert all(a[k].equal(d[k]) for k in a)
    # and the continuation stage starts from the given weights
    train_retrieval.main([*args, "--out", str(tmp_path / "c"), "--init", str(tmp_path / "a"), "--start-level", "3",
                          "--two-hop-share", "0.75", "--decay"])
    c = load_file(tmp_path / "c" / "model.safetensors")
    assert a.keys() == c.keys() and not all(a[k].equal(c[k]) for k in a)


def test_alias_prompts_define_before_use_and_keep_the_other_tasks_ids():
    from benchmarks.retrieval_task import ALL_TASKS, alias_fact, build_tokenizer, code_fact, token_ids

    rng = random.Random(5)
    name_list, value_list = names(), values()
    tok = build_tokenizer(ALL_TASKS)
    # the alias word comes after every other token: the two-task models' ids are unchanged
    assert {w: i for w, i in tok.get_vocab().items() if w != "alias"} == build_tokenizer().get_vocab()
    for k in (2, 3, 4, 6):
        for _ in range(50):
            ex = make_example(rng, "alias", k, name_list, value_list)
            assert len(ex.chunks) == k and ex.question.startswith("what is the code of ")
            asked = ex.question.split()[-1]
            # the asked name appears only in its alias's definition, and the code names only the alias
            [definition] = [c for c in ex.chunks if c.endswith(f" {asked} .")]
            alias = definition.split()[0]
            assert definition == alias_fact(alias, asked)
            assert ex.chunks.index(definition) < ex.chunks.index(code_fact(alias, ex.answer))
            assert tok.unk_token_id not in token_ids(tok, ex)


def test_grown_model_computes_what_the_small_one_did():
    """Reference: the committed 4-layer model's logits; the grown model (more layers, width, heads and one more
    token) must give the same on the small model's vocabulary, up to RMSNorm's epsilon."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.grow import grow
    from benchmarks.retrieval_task import build_tokenizer, token_ids

    small = LlamaForCausalLM.from_pretrained(MODEL).eval()
    config = LlamaConfig(vocab_size=small.config.vocab_size + 1, hidden_size=192, intermediate_size=384,
                         num_hidden_layers=7, num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=128,
                         rope_parameters=small.config.rope_parameters, tie_word_embeddings=True)
    big = grow(small, config).eval()
    tok = build_tokenizer()
    rng = random.Random(1)
    for task in ("single", "two_hop"):
        ids = torch.tensor([token_ids(tok, make_example(rng, task, 4, names(), values()))])
        with torch.no_grad():
            want, got = small(ids).logits[0], big(ids).logits[0, :, : small.config.vocab_size]
        assert torch.allclose(got, want, atol=5e-3, rtol=1e-4), (got - want).abs().max()
        assert got.argmax(-1).equal(want.argmax(-1))
    with pytest.raises(ValueError, match="head size"):
        grow(small, LlamaConfig(**{**config.to_dict(), "num_attention_heads": 4}))


def test_training_grows_a_model_and_learns_the_alias_task_reproducibly(tmp_path):
    args = ["--grow-from", str(MODEL), "--layers", "5", "--hidden", "128", "--intermediate", "256", "--batch", "6",
            "--max-steps", "2", "--eval-every", "2", "--eval-n", "4", "--max-chunks", "3", "--start-level", "3",
            "--tasks", "single", "two_hop", "alias", "--two-hop-share", "0.34", "--alias-share", "0.34"]
    for run in ("a", "b"):
        train_retrieval.main([*args, "--out", str(tmp_path / run)])
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    import json

    log = json.loads((tmp_path / "a" / "training_log.json").read_text())
    assert log["log"][0]["step"] == 0 and log["log"][0]["acc_level"]["two_hop"] > 0.5  # grown: it starts trained
    assert set(log["log"][-1]["acc_level"]) == {"single", "two_hop", "alias"} and "grown_from_record" in log
    engine = pc_rag.Engine.from_pretrained(tmp_path / "a", store="memory")
    ex = make_example(random.Random(2), "alias", 3, names(), values())
    got = accuracy.answers(engine, ex, ["1.0:chunk_start"])
    assert got["exact"] == got["full"] == got["blend 1 chunk_start"]
    with pytest.raises(SystemExit, match="alias-share"):
        train_retrieval.main([*args[:-4], "--out", str(tmp_path / "c")])


def test_block_layout_is_what_modular_computes_and_block_tuning_is_reproducible(tmp_path):
    """Block-Attention's training forward (benchmarks/block_tune.py: one masked forward with a BOS copy before each
    chunk) gives the answer logits pc_rag's modular mode gives, and its plain layout full's; a tuning run is
    reproducible bit for bit and its checkpoint loads in pc_rag with a fingerprint of its own."""
    from transformers import LlamaForCausalLM

    from benchmarks import block_tune
    from benchmarks.retrieval_task import ALL_TASKS, build_tokenizer

    model = LlamaForCausalLM.from_pretrained(DEEP, attn_implementation="sdpa").eval()
    tok = build_tokenizer(ALL_TASKS)
    engine = pc_rag.Engine.from_pretrained(DEEP, store="memory")
    rng = random.Random(5)
    for i in range(6):
        ex = make_example(rng, ALL_TASKS[i % 3], 2 + i % 4, names(), values())
        modular, full = (engine.next_token_logits(ex.prompt(), mode=m) for m in ("modular", "full"))
        assert (modular - full).abs().max() > 0.1  # the two layouts differ on this model: the check can fail
        for want, block in ((modular, True), (full, False)):
            with torch.no_grad():
                got, _ = block_tune.answer_logits(model, [block_tune.block_layout(tok.get_vocab(), tok.bos_token_id,
                                                                                  ex, block=block)])
            assert torch.allclose(got[0], want, atol=1e-4 * want.abs().max()), (block, (got[0] - want).abs().max())
    args = ["--model", str(DEEP), "--steps", "2", "--batch", "4", "--eval-every", "2", "--eval-n", "4",
            "--eval-chunks", "3", "--threads", "1"]
    for run in ("a", "b"):
        block_tune.main([*args, "--out", str(tmp_path / run)])
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    tuned = pc_rag.Engine.from_pretrained(tmp_path / "a", store="memory")
    assert tuned.runner.fingerprint != engine.runner.fingerprint
    ex = make_example(random.Random(2), "alias", 3, names(), values())
    got = accuracy.answers(tuned, ex, ["1.0:chunk_start"])
    assert got["exact"] == got["full"] == got["blend 1 chunk_start"]


def test_long_chunk_testbed_puts_each_fact_inside_prose_and_accuracy_reads_its_lengths(tmp_path):
    """The long-chunk testbed (issue 55): every chunk 64-256 tokens with its fact intact inside, the engine's
    tokenization equal to training's, and a model trained on it carries its lengths to benchmarks/accuracy.py."""
    from benchmarks.retrieval_task import (
        ALL_TASKS,
        TASKS,
        build_tokenizer,
        chunk_tokens_of,
        in_prose,
        prose_words,
        token_ids,
    )

    tok = build_tokenizer(ALL_TASKS, prose=True)
    assert len(tok) == len(build_tokenizer(ALL_TASKS)) + len(prose_words())  # the old ids stay where they were
    rng = random.Random(8)
    for task in ALL_TASKS:
        ex = make_example(rng, task, 4, names(), values())
        long = in_prose(rng, ex, 64, 256)
        assert long.question == ex.question and long.answer == ex.answer
        for fact, chunk in zip(ex.chunks, long.chunks, strict=True):
            assert f" {fact} " in f" {chunk} " and 64 <= len(tok(chunk, add_special_tokens=False)["input_ids"]) <= 256
        assert tok.unk_token_id not in token_ids(tok, long)
    args = ["--grow-from", str(MODEL), "--chunk-tokens", "64", "96", "--batch", "2", "--max-steps", "2",
            "--eval-every", "2", "--eval-n", "2", "--max-chunks", "3", "--start-level", "3", "--out", str(tmp_path)]
    train_retrieval.main(args)
    assert chunk_tokens_of(tmp_path) == (64, 96) and chunk_tokens_of(MODEL) is None
    result = accuracy.run(str(tmp_path), 2, [3], 5, ["1.0:chunk_start"])
    assert all(r["accuracy"]["exact"] == r["accuracy"]["full"] == r["accuracy"]["blend 1 chunk_start"]
               for r in result["rows"])
    assert all(r["work"]["modular"] == 0.0 and r["work"]["full"] == 1.0 for r in result["rows"])

    # Block-Attention on it: the block layout of a prose prompt is still what modular computes, and the tuned
    # checkpoint keeps the lengths (its tuned_from_record) for accuracy.py
    from transformers import LlamaForCausalLM

    from benchmarks import block_tune

    model = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    engine = pc_rag.Engine.from_pretrained(tmp_path, store="memory")
    vocab = build_tokenizer(TASKS, prose=True).get_vocab()  # this run's tasks: no alias word
    assert len(vocab) == model.config.vocab_size
    ex = in_prose(random.Random(3), make_example(random.Random(3), "two_hop", 3, names(), values()), 64, 96)
    want = engine.next_token_logits(ex.prompt(), mode="modular")
    assert (want - engine.next_token_logits(ex.prompt(), mode="full")).abs().max() > 0.1  # the check can fail
    with torch.no_grad():
        got, _ = block_tune.answer_logits(model, [block_tune.block_layout(vocab, engine.tokenizer.bos_token_id, ex)])
    assert torch.allclose(got[0], want, atol=1e-4 * want.abs().max()), (got[0] - want).abs().max()
    block_tune.main(["--model", str(tmp_path), "--out", str(tmp_path / "block"), "--steps", "1", "--batch", "2",
                     "--eval-every", "1", "--eval-n", "2", "--eval-chunks", "3", "--threads", "1", "--bf16"])
    assert chunk_tokens_of(tmp_path / "block") == (64, 96)


def test_ttft_benchmark_runs_and_stores_the_formula_bytes(tiny_path, tmp_path):
    from benchmarks import ttft

    result = ttft.run(tiny_path, lengths=[600], reps=1, decode_tokens=8)
    assert len(result["rows"]) == 1
    row = result["rows"][0]
    assert result["bytes_per_token_stored"] == result["bytes_per_token_formula"]
    redis_columns = {"pc_modular_warm_redis", "pc_exact_warm_redis"}  # only with a redis-server binary
    for key, _ in ttft.COLUMNS:
        if key in row or key not in redis_columns:
            assert row[key]["median_s"] > 0, key
    steps = row["load_steps"]["modular_disk"]
    assert steps["bytes_read"] > 0 and steps["read_ms"] > 0 and steps["copy_ms"] > 0
    assert row["hf_generate_long"]["tokens_per_s"] > 0
    md = ttft.markdown(result)
    assert "| decode tok/s full |" in md and "| modular disk |" in md
    ttft.plot(result, tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").stat().st_size > 0


def test_loads_benchmark_runs_prefetch_and_compression(tiny_path):
    pytest.importorskip("langchain_pc_rag")
    from benchmarks import loads

    result = loads.run(tiny_path, lengths=[600], reps=1, fidelity_prompts=2)
    row = result["rows"][0]
    assert set(row["prefetch"]) >= {"memory", "disk", "disk_prefetch", "disk_prefetch_rerank"}
    assert row["prefetch"]["disk_prefetch"]["ttft_ms"] > 0
    # int8 blocks: a quarter of float32's bytes, plus scales and header
    assert 0.24 < row["bytes_per_token"]["disk int8"] / row["bytes_per_token"]["disk"] < 0.3
    assert result["fidelity"]["none"]["kl_modular"] == 0.0  # the reference against itself
    assert "| int8 |" in loads.markdown(result)


def test_gpu_check_runs_its_checks_on_the_cpu(capsys):
    # The CUDA check's own code paths, on the tiny models (the CUDA run itself needs a GPU: docs/models.md).
    from benchmarks import gpu_check

    assert gpu_check.main(["--device", "cpu", "--small"]) == 0
    out = capsys.readouterr().out
    assert out.count("| pass |") == 18 and "FAIL" not in out and out.count("| measured |") == 3  # 3 models
    if not torch.cuda.is_available():  # without a GPU it says so and runs nothing
        assert gpu_check.main([]) == 0 and "no CUDA device" in capsys.readouterr().out


def test_serving_load_sends_the_trace_and_checks_answers_against_one_at_a_time(tiny_path, tmp_path):
    """benchmarks.serving's load part end to end on the tiny model: a real `pc-rag serve`, the openai client, two
    rates, follow-ups, the replay; every request answered, the record the docs quote written."""
    import json

    from benchmarks import serving

    out = tmp_path / "out"
    assert serving.main(["--out", str(out), "--model", str(tiny_path), "--chunks", "40", "--chunk-words", "40",
                         "--requests", "50", "--trace", "documents",
                         "--systems", "pc-rag modular", "pc-rag exact", "--rates", "4", "--max-rate", "8",
                         "--requests-per-rate", "6", "--slo", "60", "--concurrency", "1", "5",
                         "--prefix-tokens", "1500"]) == 0
    result = json.loads((out / "serving.json").read_text())
    # KV held by n requests at once over one prefix, whose bytes are the formula's 2 x layers x tokens x kv_heads x
    # head_dim x 4 (fp32): the prefix once, read in place (model/cache.py), and each request's own slots (a
    # buffer of 256 slots or more), so four more requests add less than three prefixes (copying it: four or more)
    config = json.loads((tiny_path / "config.json").read_text())
    one, five = result["concurrency"]["1"], result["concurrency"]["5"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert one["prefix_kv_bytes"] % per_token == 0 and 1480 <= one["prefix_kv_bytes"] // per_token <= 1510
    assert one["kv_bytes"] >= one["prefix_kv_bytes"]
    assert 0 < five["kv_bytes"] - one["kv_bytes"] < 3 * one["prefix_kv_bytes"]
    for name in ("pc-rag modular", "pc-rag exact"):
        rates = result["systems"][name]["rates"]
        assert [r["rate"] for r in rates] == [4.0, 8.0] and result["systems"][name]["max_rate_rps"] == 8.0
        assert all(r["answered"] == r["requests"] == 6 and r["lost"] == 0 for r in rates)
        assert all(r["ttft_p50_s"] > 0 and r["prompt_tokens_mean"] > 100 for r in rates)
        assert all(0 < r["computed_tokens_mean"] <= r["prompt_tokens_mean"] for r in rates)
        assert all(r["encode_forwards_per_request"] >= 0 and r["after_reply_forwards_per_request"] >= 0
                   for r in rates)
    # exact never encodes a passage, modular's plain text does (on the path or after the reply) from the first rate
    assert sum(r["encode_forwards_per_request"] + r["after_reply_forwards_per_request"]
               for r in result["systems"]["pc-rag exact"]["rates"]) == 0
    assert sum(r["encode_forwards_per_request"] + r["after_reply_forwards_per_request"]
               for r in result["systems"]["pc-rag modular"]["rates"]) > 0
    # exact equals full whatever the load: greedy answers equal the same request sent alone
    assert all(r["equal_to_one_at_a_time"] == 1.0 for r in result["systems"]["pc-rag exact"]["rates"])
    assert (out / "serving.md").read_text().count("| pc-rag") == 2 and (out / "serving.png").exists()


def test_follow_ups_continue_an_earlier_request_with_its_chunks():
    from benchmarks import serving

    trace = serving.rag_trace(30, 200, 1.1, seed=1, follow_ups=0.3)
    assert [r.index for r in trace] == list(range(200)) and any(r.parent is not None for r in trace)
    for r in trace:
        assert (r.parent is None) == (r.turn == 0)
        if r.parent is not None:
            p = trace[r.parent]
            assert p.index < r.index and p.chunks == r.chunks and p.turn == r.turn - 1


def test_soak_sends_every_kind_and_reports_the_curve(tiny_path, tmp_path):
    """benchmarks.soak end to end, small: a real `pc-rag serve` with three tenants' keys answers every request
    (reference: the statuses, all 200), each sample has the server's RSS and what its bounded caches hold, and the
    growth is measured from the first sample at or after the warm-up."""
    import json

    from benchmarks import soak

    report = soak.main(["--model", str(tiny_path), "--requests", "60", "--clients", "2", "--sample-every", "20",
                        "--warmup", "20", "--out", str(tmp_path)])
    assert report["requests_done"] == 60 and sum(report["kinds"].values()) == 60
    assert [row["requests"] for row in report["curve"]] == [20, 40, 60]
    assert report["curve"][-1]["statuses"] == {200: 60}
    assert all(row["rss_mib"] > 10 and {"prefix_blocks", "replies", "passages"} <= set(row["caches"])
               for row in report["curve"])
    assert report["growth"]["from_requests"] == 20 and report["growth"]["to_requests"] == 60
    assert json.loads((tmp_path / "soak.json").read_text())["requests_done"] == 60
    assert "| 60 |" in (tmp_path / "soak.md").read_text()


def test_soak_mix_is_seeded_and_draws_every_kind():
    """The same seed gives the same bodies (reference: a second generator); 2,000 draws cover every kind."""
    from benchmarks import soak

    docs = [f"document {i} " * 20 for i in range(8)]
    first, second = soak.Mix(3, docs, 10, 4), soak.Mix(3, docs, 10, 4)
    drawn = [first.body() for _ in range(2000)]
    assert drawn[:50] == [second.body() for _ in range(50)]
    assert {kind for kind, *_ in drawn} == set(soak.KINDS)
    assert soak.growth([{"requests": 5, "rss_mib": 1.0}], 0) == {}


def test_the_documents_trace_has_paragraphs_and_questions_of_15_to_40_tokens():
    """Reference: the bench model's tokenizer on the trace's own questions; the documents' blank lines as the passage
    rule sees them (several passages per document)."""
    from benchmarks import serving
    from pc_rag.passages import passage_spans
    from pc_rag.testing import SIZES, train_tokenizer

    docs = serving.corpus_documents(60)
    assert sum(len(passage_spans(d)) for d in docs) >= 3 * len(docs)  # paragraphs: several passages a document
    tokenizer = train_tokenizer(SIZES["bench"].vocab_size)
    trace = serving.rag_trace(60, 1600, 1.1, seed=2, question_words=(1, 20))
    lengths = [len(tokenizer.encode(r.question).ids) for r in trace if r.turn == 0]
    assert 15 <= min(lengths) and max(lengths) <= 40 and max(lengths) - min(lengths) >= 15
