"""Loading checkpoints (pc_rag.model.checkpoint): every bad path a CheckpointError naming it and what is wrong,
quantized HF checkpoints refused before any weight loads, and GGUF files (written here from the tiny checkpoint
with the `gguf` package's writer, offline: pc_rag.testing.write_gguf) loaded as their HF twin.

References: the HF checkpoint the GGUF was written from, run by pc_rag's own forward (f32: logits within 1e-4; Q8_0:
within the tolerance measured below), its tokenizer's ids on real text, and its fingerprint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pc_rag
from pc_rag import CheckpointError
from pc_rag.errors import UnsupportedModelError
from pc_rag.model import LlamaRunner
from pc_rag.testing import pydoc_corpus, write_gguf

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (pip install 'pc-rag[gguf]')")
pytest.importorskip("accelerate", reason="transformers reads GGUF with accelerate (pip install 'pc-rag[gguf]')")

# Q8_0 keeps each block of 32 weights as int8 with one fp16 scale: about 0.4% relative error per weight. On the tiny
# model's logits (|logit| up to ~2) it moved them by at most 0.028 over the prompts below (measured, seed 0); the
# bound leaves room for other prompts, and is 10x below the spread of the logits themselves.
Q8_0_TOLERANCE = 0.1


def own_logits(runner: LlamaRunner, ids: list[int]) -> torch.Tensor:
    """The last token's logits from pc_rag's own forward (the layer loop, not HF's)."""
    cache = runner.new_cache(len(ids))
    return runner.forward(cache, ids, list(range(len(ids))), list(range(len(ids))))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(tiny_path, out / f"tiny-{q.lower()}.gguf", q) for q in ("F32", "Q8_0")}


@pytest.fixture(scope="module")
def hf_runner(tiny_path):
    return LlamaRunner.from_pretrained(str(tiny_path))


def _prompts(tokenizer, n=4, length=48):
    return [tokenizer(text, add_special_tokens=True)["input_ids"][:length] for text in pydoc_corpus()[:n]]


def test_an_f32_gguf_answers_like_its_hf_checkpoint(ggufs, hf_runner):
    runner = LlamaRunner.from_pretrained(str(ggufs["F32"]))
    for ids in _prompts(hf_runner.tokenizer):
        for n in (1, 7, len(ids)):
            assert torch.allclose(own_logits(runner, ids[:n]), own_logits(hf_runner, ids[:n]), atol=1e-4, rtol=0)


def test_a_q8_0_gguf_answers_within_the_measured_tolerance(ggufs, hf_runner):
    runner = LlamaRunner.from_pretrained(str(ggufs["Q8_0"]))
    diffs = [float((own_logits(runner, ids) - own_logits(hf_runner, ids)).abs().max())
             for ids in _prompts(hf_runner.tokenizer)]
    assert max(diffs) < Q8_0_TOLERANCE, diffs
    assert max(diffs) > 1e-4  # it is quantized: the weights really changed
    assert runner.dtype == torch.float32  # activations in the dtype asked for, the matrices still Q8_0
    assert runner.memory()["matrices"] == {"Q8_0": 16}


def test_a_gguf_runs_in_the_requested_dtype(ggufs):
    runner = LlamaRunner.from_pretrained(str(ggufs["Q8_0"]), dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and next(runner.model.parameters()).dtype == torch.bfloat16


def test_the_tokenizer_comes_from_the_gguf_and_encodes_like_the_checkpoints(ggufs, hf_runner):
    runner = LlamaRunner.from_pretrained(str(ggufs["F32"]))
    # transformers adds GPT-2's <|endoftext|> to a byte-level GGUF vocabulary that lacks it, one id past the model's:
    # dropped at load (it was an IndexError mid-request), so that text is plain text, as in the checkpoint.
    texts = [t[:400] for t in pydoc_corpus()[:20]] + ["<|start_header_id|>user<|end_header_id|>\n\nhé ✓ 42",
                                                      "a <|endoftext|> b"]
    for text in texts:
        assert runner.tokenizer(text)["input_ids"] == hf_runner.tokenizer(text)["input_ids"], text[:40]
    assert runner.tokenizer.eos_token_id == hf_runner.tokenizer.eos_token_id
    assert runner.tokenizer.chat_template == hf_runner.tokenizer.chat_template
    assert len(runner.tokenizer) == len(hf_runner.tokenizer) == runner.config.vocab_size


def test_engine_from_pretrained_takes_a_gguf_file_or_a_folder_holding_one(ggufs, tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(ggufs["F32"], folder / "model.gguf")
    by_file = pc_rag.Engine.from_pretrained(ggufs["F32"], store="memory")
    by_folder = pc_rag.Engine.from_pretrained(folder, store="memory")
    a = by_file.generate("Decorators are", max_new_tokens=8, mode="full")
    b = by_folder.generate("Decorators are", max_new_tokens=8, mode="full")
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


def test_the_fingerprint_covers_the_gguf_file(ggufs, tmp_path, tiny_path):
    """The dequantized weights (and the config and tokenizer read from the file) are hashed: the same file gives the
    same fingerprint, another quantization or one changed weight another one."""
    f32 = LlamaRunner.from_pretrained(str(ggufs["F32"])).fingerprint
    assert LlamaRunner.from_pretrained(str(ggufs["F32"])).fingerprint == f32
    assert LlamaRunner.from_pretrained(str(ggufs["Q8_0"])).fingerprint != f32
    # One weight changed in the checkpoint, written again: another fingerprint.
    changed = tmp_path / "changed"
    shutil.copytree(tiny_path, changed)
    from safetensors.torch import load_file, save_file

    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] += 0.5
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    other = LlamaRunner.from_pretrained(str(write_gguf(changed, tmp_path / "changed.gguf"))).fingerprint
    assert other != f32


# ---- bad paths ------------------------------------------------------------------------------------------------------
def _copy(tiny_path, tmp_path, name="ckpt"):
    out = tmp_path / name
    shutil.copytree(tiny_path, out)
    return out


def _refused(path, *fragments, error=CheckpointError):
    with pytest.raises(error) as info:
        pc_rag.Engine.from_pretrained(path)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_missing_folder(tmp_path):
    _refused(tmp_path / "nowhere" / "Llama-3.2-1B", "no such file or folder")


def test_a_gguf_named_file_that_is_not_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text('{"model_type": "llama"}')
    _refused(fake, "not a GGUF file")


def test_a_folder_without_config_json(tiny_path, tmp_path):
    folder = _copy(tiny_path, tmp_path)
    (folder / "config.json").unlink()
    _refused(folder, "no config.json")


def test_a_folder_with_several_ggufs_and_no_config(ggufs, tmp_path):
    for name, path in ggufs.items():
        shutil.copy(path, tmp_path / f"{name}.gguf")
    _refused(tmp_path, "2 GGUF files", "F32.gguf", "Q8_0.gguf")


def test_a_file_that_is_not_a_checkpoint(tiny_path, tmp_path):
    _refused(tiny_path / "model.safetensors", "not a checkpoint", "a safetensors file")
    _refused(tiny_path / "config.json", "not a checkpoint")


def test_a_config_that_is_not_json(tiny_path, tmp_path):
    folder = _copy(tiny_path, tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        pc_rag.Engine.from_pretrained(folder)


def test_no_weights(tiny_path, tmp_path):
    folder = _copy(tiny_path, tmp_path)
    (folder / "model.safetensors").unlink()
    _refused(folder, "no weights")


def test_unreadable_weights(tiny_path, tmp_path):
    folder = _copy(tiny_path, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])  # a download cut short
    _refused(folder, "weights cannot be read")


def test_an_unsupported_gguf_architecture_is_named(ggufs, tmp_path, monkeypatch):
    """A GGUF of a family transformers does not read from GGUF: its error, naming the path, as an
    UnsupportedModelError."""
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("GGUF model with architecture mamba3 is not supported yet.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    _refused(ggufs["F32"], "mamba3", "Llama, Mistral", error=UnsupportedModelError)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_a_quantized_checkpoint_is_refused_before_any_weight_loads(tiny_path, tmp_path, method, monkeypatch):
    folder = _copy(tiny_path, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_loading)
    _refused(folder, f"quantized checkpoint ({method}", "unquantized checkpoint", "GGUF")


def test_without_the_gguf_package_the_error_names_the_extra(ggufs, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    _refused(ggufs["F32"], "needs the gguf package", 'pip install "pc-rag[gguf]"')
