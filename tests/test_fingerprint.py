"""The model fingerprint, part of every store key: every weight byte, the forward-relevant config, the dtype and
the tokenizer; never the folder the checkpoint was loaded from."""

import json
import shutil

import pytest
import torch
import transformers
import xxhash

import pc_rag
from pc_rag import Chunk, Text
from pc_rag.model import LlamaRunner, hash_tensor
from pc_rag.store import MemoryStore

ODD_TOKEN = 1001  # a sample of every other embedding row (the old fingerprint) never saw odd token ids


def fingerprint(path, dtype="float32") -> str:
    return LlamaRunner.from_pretrained(str(path), dtype=dtype).fingerprint


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def fine_tune_embedding_row(model, token_id: int) -> None:
    """Change one embedding row, as a fine-tune that trained a few tokens would."""
    with torch.no_grad():
        model.model.embed_tokens.weight[token_id] *= -3.0


def test_same_weights_in_another_folder_share_the_fingerprint(tiny_path, tmp_path):
    # Reference: the checkpoint where it was built. A copied folder (another machine, a moved model) must get the
    # same fingerprint, or a disk/Redis cache is never shared.
    moved = copy_checkpoint(tiny_path, tmp_path / "elsewhere")
    assert fingerprint(moved) == fingerprint(tiny_path)


def test_one_changed_embedding_row_changes_the_fingerprint(tiny_path, tmp_path):
    # The same folder before and after, so nothing but the weights can tell the two apart.
    checkpoint = copy_checkpoint(tiny_path, tmp_path / "checkpoint")
    before = fingerprint(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    fine_tune_embedding_row(model, ODD_TOKEN)
    model.save_pretrained(checkpoint)
    assert fingerprint(checkpoint) != before


def test_a_one_bit_weight_change_in_memory_changes_the_fingerprint(tiny_path):
    # A model never saved to files (weights in memory only) is fingerprinted from its tensors: the smallest
    # possible change, one float moved to its neighbour, in the last row of the last weight, must show.
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_path)
    before = LlamaRunner(model, tok).fingerprint
    with torch.no_grad():
        w = model.lm_head.weight
        w[-1, -1] = torch.nextafter(w[-1, -1], torch.tensor(float("inf")))
    assert LlamaRunner(model, tok).fingerprint != before


def test_a_fine_tune_never_reuses_the_base_models_kv(tiny_path, docs):
    """The bug report: a fine-tune that changed a few (odd) embedding rows reused the base model's KV from a
    shared store, in `exact` mode too, and answered with wrong tokens."""
    store = MemoryStore()
    base = pc_rag.Engine.from_pretrained(tiny_path, store=store)
    ids = base.segmenter.ids(docs[0])
    token = next(t for t in ids if t % 2 == 1)  # an odd token id of the chunk
    tuned_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path)  # loaded from the same folder
    fine_tune_embedding_row(tuned_model, token)
    prompt = [Text("Sys. "), Chunk(docs[0]), Text("\nQ?")]
    base.warm([docs[0]], progress=False)  # stores the chunk's KV (modular)
    base.generate(prompt, mode="exact", max_new_tokens=1)  # stores the exact-prefix nodes
    tuned = pc_rag.Engine(tuned_model, base.tokenizer, store=store)
    assert tuned.generate(prompt, mode="exact", max_new_tokens=1).cached_tokens == 0
    # Reference: the tuned model's own full prefill (<= 1e-4, as in every exact test).
    assert (tuned.next_token_logits(prompt, "exact") - tuned.next_token_logits(prompt, "full")).abs().max() <= 1e-4
    # Modular, with other text before the chunk (no exact prefix to find): the base model's chunk KV is not
    # reused; reference: the tuned model over an empty store (the same computation, <= 1e-5).
    other = [Text("Other. "), Chunk(docs[0]), Text("\nQ?")]
    gen = tuned.generate(other, mode="modular", max_new_tokens=1)
    assert [s.origin for s in gen.sources if s.kind == "chunk"] == ["computed"]
    alone = pc_rag.Engine(tuned.model, tuned.tokenizer, store=MemoryStore())
    lm = tuned.next_token_logits(other, "modular")
    assert (lm - alone.next_token_logits(other, "modular")).abs().max().item() <= 1e-5


def test_dtype_changes_the_fingerprint(tiny_path):
    assert fingerprint(tiny_path, "bfloat16") != fingerprint(tiny_path, "float32")


def test_a_changed_tokenizer_changes_the_fingerprint(tiny_path, tmp_path):
    other = copy_checkpoint(tiny_path, tmp_path / "other-tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<|tool|>"], special_tokens=True)
    tok.save_pretrained(other)
    assert fingerprint(other) != fingerprint(tiny_path)


def test_tokenizer_calls_with_truncation_or_padding_leave_the_fingerprint(tiny_path, loaded):
    # A fast tokenizer keeps the truncation/padding state of its last call in its backend: not part of what it is.
    model, _ = loaded
    tok = transformers.AutoTokenizer.from_pretrained(tiny_path)
    before = LlamaRunner(model, tok).fingerprint
    tok(["one two three", "four"], truncation=True, max_length=2, padding=True)
    assert LlamaRunner(model, tok).fingerprint == before


def test_config_fields_outside_the_forward_leave_the_fingerprint(tiny_path, tmp_path):
    other = copy_checkpoint(tiny_path, tmp_path / "relabelled")
    edit_config(other, _name_or_path="meta-llama/elsewhere", transformers_version="5.0.0", temperature=0.3,
                max_length=77, do_sample=True, id2label={"0": "A"}, label2id={"A": 0}, use_cache=False,
                initializer_range=0.5)
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "top_p": 0.5}))
    assert fingerprint(other) == fingerprint(tiny_path)


@pytest.mark.parametrize("field, value", [("rms_norm_eps", 0.5), ("hidden_act", "gelu"),
                                          ("rope_parameters", {"rope_type": "default", "rope_theta": 500.0})])
def test_config_fields_of_the_forward_change_the_fingerprint(tiny_path, tmp_path, docs, field, value):
    other = copy_checkpoint(tiny_path, tmp_path / "other-config")
    edit_config(other, **{field: value})
    assert fingerprint(other) != fingerprint(tiny_path)
    # and they really change the forward (same weights, so only the config can explain it): logits move by > 1e-3
    a, b = (pc_rag.Engine.from_pretrained(p, store=MemoryStore()) for p in (tiny_path, other))
    prompt = [Chunk(docs[0]), Text("\nQ?")]
    assert (a.next_token_logits(prompt, "full") - b.next_token_logits(prompt, "full")).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hashing_through_a_host_buffer_covers_the_same_bytes(dtype):
    # Weights on an accelerator are copied to the host in chunks; reference: the one-piece hash of a CPU tensor.
    # A chunk size that does not divide the tensor exercises the last, partial chunk.
    t = torch.randn(37, 53).to(dtype).t()  # non-contiguous, as a transposed view would be
    direct, staged = xxhash.xxh3_128(), xxhash.xxh3_128()
    hash_tensor(direct, t)
    hash_tensor(staged, t, chunk_bytes=1000, stage=True)
    assert staged.hexdigest() == direct.hexdigest()
    t2 = t.clone()
    t2[-1, -1] = torch.nextafter(t2[-1, -1], torch.tensor(float("inf"), dtype=dtype))
    changed = xxhash.xxh3_128()
    hash_tensor(changed, t2, chunk_bytes=1000, stage=True)
    assert changed.hexdigest() != direct.hexdigest()
