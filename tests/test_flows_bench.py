"""benchmarks/flows.py on its shortest flow: the JSON it writes, and that a repeated system prompt is reused.

Reference: the bound the script computes itself (the longest common token prefix with an earlier request's
prompt and reply). In exact mode the engine can reuse at most that much, and with the same ~800-token system
prompt before each new question it must reuse most of the prompt from the second request on.
"""

import json

import pytest

TURN_KEYS = {"turn", "calls", "input_tokens", "cache_read", "bound", "reuse_share", "bound_share", "ratio"}


def test_system_prompt_flow_reports_reuse_of_the_repeated_system_prompt(tiny_path, tmp_path):
    pytest.importorskip("langchain_pc_rag")
    from benchmarks import flows

    out = tmp_path / "flows.json"
    report = flows.main(["--model", str(tiny_path), "--flows", "system_prompt", "--modes", "exact",
                         "--max-new-tokens", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report) == {"model", "max_new_tokens", "flows"}
    run = report["flows"]["system_prompt"]["exact"]
    assert set(run) == {"seconds", "turns"}
    turns = run["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(set(t) == TURN_KEYS for t in turns)
    assert turns[0]["cache_read"] == turns[0]["bound"] == 0  # an empty store
    for t in turns[1:]:
        assert t["calls"] == 1
        assert 0 < t["cache_read"] <= t["bound"] < t["input_tokens"]
        assert t["reuse_share"] > 0.5  # the system prompt is most of the prompt
