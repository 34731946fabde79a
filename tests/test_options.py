"""Request options: every wrong type or value is a PCRagError that names the argument, raised at the call.

Reference: the argument's own name must appear in the message (a user reads which argument to fix), and
the exception must be a PCRagError (one family) and a ValueError or TypeError (what Python code catches).
"""

import math

import numpy as np
import pytest
import torch

import pc_rag
from pc_rag import Chunk, GenerationOptions, Text
from pc_rag.decode import Sampling
from pc_rag.options import check_device

# (keyword arguments, the argument the message must name, the exception class)
BAD_OPTIONS = [
    ({"seed": "abc"}, "seed", TypeError),
    ({"seed": 2**64}, "seed", ValueError),
    ({"seed": True}, "seed", TypeError),
    ({"seed": 1.0}, "seed", TypeError),
    ({"temperature": "0.7"}, "temperature", TypeError),
    ({"temperature": -0.1}, "temperature", ValueError),
    ({"temperature": math.nan}, "temperature", ValueError),
    ({"temperature": math.inf}, "temperature", ValueError),
    ({"temperature": False}, "temperature", TypeError),
    ({"top_p": 0.0}, "top_p", ValueError),
    ({"top_p": 1.5}, "top_p", ValueError),
    ({"top_p": math.nan}, "top_p", ValueError),
    ({"top_p": "1"}, "top_p", TypeError),
    ({"max_new_tokens": 1.5}, "max_new_tokens", TypeError),
    ({"max_new_tokens": "5"}, "max_new_tokens", TypeError),
    ({"max_new_tokens": True}, "max_new_tokens", TypeError),
    ({"max_new_tokens": 0}, "max_new_tokens", ValueError),
    ({"max_new_tokens": None}, "max_new_tokens", TypeError),
    ({"stop": [1]}, "stop", TypeError),
    ({"stop": ["ok", None]}, "stop[1]", TypeError),
    ({"stop": b"\n"}, "stop", TypeError),
    ({"stop": 5}, "stop", TypeError),
    ({"recompute_ratio": "0.5"}, "recompute_ratio", TypeError),
    ({"recompute_ratio": 1.5}, "recompute_ratio", ValueError),
    ({"recompute_ratio": -0.1}, "recompute_ratio", ValueError),
    ({"recompute_ratio": math.inf}, "recompute_ratio", ValueError),
    ({"mode": "fast"}, "mode", ValueError),
    ({"mode": None}, "mode", ValueError),
]


def _ids(cases):
    return [f"{k}={v!r}"[:40] for (kw, *_) in cases for k, v in kw.items()]


@pytest.mark.parametrize("kwargs, name, kind", BAD_OPTIONS, ids=_ids(BAD_OPTIONS))
def test_bad_options_name_the_argument(kwargs, name, kind):
    with pytest.raises(pc_rag.PCRagError, match=name.replace("[", r"\[")) as caught:
        GenerationOptions(**kwargs)
    assert isinstance(caught.value, kind)


def test_unknown_mode_is_a_prompt_error_naming_the_choices():
    with pytest.raises(pc_rag.PromptError, match="unknown mode 'fast'; choose one of full, exact, modular, blend"):
        GenerationOptions(mode="fast")


def test_options_are_normalised():
    o = GenerationOptions(max_new_tokens=np.int64(4), temperature=1, top_p=np.float32(0.5), stop="\n\n",
                          seed=np.uint64(2**64 - 1), recompute_ratio=0)
    assert (o.max_new_tokens, o.temperature, o.top_p, o.seed, o.recompute_ratio) == (4, 1.0, 0.5, 2**64 - 1, 0.0)
    assert type(o.max_new_tokens) is int and type(o.seed) is int and type(o.temperature) is float
    assert o.stop == ("\n\n",)
    assert GenerationOptions().stop == GenerationOptions(stop=None).stop == ()
    assert GenerationOptions(stop=["a", "", "b"]).stop == ("a", "b")  # an empty stop would match at once
    assert GenerationOptions(stop=(s for s in ["x"])).stop == ("x",)
    assert GenerationOptions(seed=-(2**63)).seed == -(2**63)  # torch takes signed 64-bit seeds too


def test_sampling_shares_the_checks():
    with pytest.raises(pc_rag.OptionTypeError, match="temperature"):
        Sampling(temperature="0.7")
    with pytest.raises(pc_rag.OptionError, match="seed"):
        Sampling(seed=2**64)
    o = GenerationOptions(temperature=0.5, top_p=0.9, seed=3)
    assert Sampling.from_options(o) == Sampling(0.5, 0.9, 3)


# ---- the engine builds the options at the call -----------------------------------------------------------
CALLS = {
    "generate": lambda engine, prompt, **kw: engine.generate(prompt, **kw),
    "stream": lambda engine, prompt, **kw: engine.stream(prompt, **kw),  # no next(): must raise at the call
    "stream_generation": lambda engine, prompt, **kw: engine.stream_generation(prompt, **kw),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("kwargs, name, kind", BAD_OPTIONS, ids=_ids(BAD_OPTIONS))
def test_engine_checks_options_at_the_call(engine, call, kwargs, name, kind):
    with pytest.raises(pc_rag.PCRagError, match=name.replace("[", r"\[")) as caught:
        CALLS[call](engine, [Text("hello")], **kwargs)
    assert isinstance(caught.value, kind)


def test_stream_with_zero_tokens_fails_at_the_call_not_at_next(engine):
    with pytest.raises(pc_rag.OptionError, match="max_new_tokens"):
        engine.stream([Text("hello")], max_new_tokens=0)
    with pytest.raises(pc_rag.OptionError, match="max_new_tokens"):
        engine.stream_generation([Text("hello")], max_new_tokens=0)


@pytest.mark.parametrize("kwargs, name", [({"mode": "fast"}, "mode"), ({"recompute_ratio": "0.5"}, "recompute_ratio"),
                                          ({"recompute_ratio": math.nan}, "recompute_ratio")])
def test_next_token_logits_checks_mode_and_ratio(engine, kwargs, name):
    with pytest.raises(pc_rag.PCRagError, match=name):
        engine.next_token_logits([Text("hello")], **kwargs)


# ---- prompts and segments --------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, words", [
    (None, "NoneType"),
    (123, "int"),
    ((Text(t) for t in ["a", "b"]), "generator"),
    ({Text("a")}, "set"),
])
def test_prompt_of_the_wrong_type_is_a_prompt_error(engine, prompt, words):
    with pytest.raises(pc_rag.PromptError, match=f"prompt must be .*got {words}"):
        engine.generate(prompt, max_new_tokens=1)


@pytest.mark.parametrize("make, words", [
    (lambda: Text(None), r"Text\(text=...\) must be a str, got NoneType"),
    (lambda: Chunk(b"bytes"), r"Chunk\(text=...\) must be a str, got bytes"),
    (lambda: Text("a", position="3"), "position must be an int"),
    (lambda: Chunk("a", encode_position=-1), "encode_position must be >= 0"),
])
def test_segments_check_their_fields(make, words):
    with pytest.raises(pc_rag.PromptError, match=words):
        make()


def test_lone_surrogate_is_a_prompt_error_naming_the_segment(engine):
    # Today's tokenizers raise "TextEncodeInput must be Union[...]" for such text: no hint of which segment.
    with pytest.raises(pc_rag.PromptError, match=r"Chunk\('doc \\ud83d tail'\) holds a lone surrogate"):
        engine.generate([Text("q"), Chunk("doc \ud83d tail")], max_new_tokens=1)
    with pytest.raises(pc_rag.PromptError, match="lone surrogate"):
        engine.generate("plain \udcff string", max_new_tokens=1)
    with pytest.raises(pc_rag.PromptError, match="lone surrogate"):
        engine.warm(["\ud800"], progress=False)
    assert engine.generate([Text("emoji 😀 pairs are fine")], max_new_tokens=1).prompt_tokens > 0


@pytest.mark.parametrize("chunks, words", [
    ([None], r"chunks\[0\] is a NoneType"),
    (["ok", 5], r"chunks\[1\] is a int"),
    ("one string", "not a single one"),
])
def test_warm_checks_its_chunks(engine, chunks, words):
    with pytest.raises(pc_rag.PromptError, match=words):
        engine.warm(chunks, progress=False)
    assert engine.stats()["tiers"][0]["entries"] == 0  # checked before any encode


# ---- the device --------------------------------------------------------------------------------------------
def test_check_device_accepts_cpu():
    assert check_device("cpu") == "cpu"
    assert check_device(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("device, words", [
    ("garbage", "'garbage' is not a device"),
    ("cuda:x", "'cuda:x' is not a device"),
    ("meta", "runs on cpu, cuda"),
    (0, "device must be a string"),
])
def test_check_device_rejects_what_is_not_a_device(device, words):
    with pytest.raises(pc_rag.OptionError, match=words):
        check_device(device)


def test_check_device_rejects_missing_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(pc_rag.OptionError, match="device 'cuda': .*CUDA"):
        check_device("cuda")
    with pytest.raises(pc_rag.OptionError, match="device 'mps': MPS"):
        check_device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("cuda:0") == "cuda:0"
    with pytest.raises(pc_rag.OptionError, match="device 'cuda:1': only 1 CUDA device"):
        check_device("cuda:1")
