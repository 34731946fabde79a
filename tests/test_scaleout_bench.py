"""benchmarks/scaleout.py's own bookkeeping, without processes: the trace's messages and the summary's arithmetic.
Reference: counts and shares worked out by hand."""

from __future__ import annotations

from benchmarks.scaleout import conversation, summarize


def test_chats_and_rag_turns_alternate_by_user_and_mark_passages_as_chunks():
    passages = [f"passage {i}" for i in range(12)]
    chat, rag = conversation(0, 3, passages), conversation(1, 3, passages)
    assert all(isinstance(m["content"], str) for m in chat) and len(chat) == 3
    parts = rag[0]["content"]
    assert [p.get("cache_control") is not None for p in parts] == [True, False, True, False]
    assert parts[0]["text"] == passages[5] and parts[2]["text"] == passages[8]
    assert rag[1]["content"][0]["text"] == passages[8]  # the next turn asks about the previous turn's passage again


def test_summary_counts_reuse_by_turn_and_lost_answers():
    rows = [{"user": 0, "turn": 0, "kind": "chat", "ttft_s": 0.1, "total_s": 0.2, "prompt_tokens": 100,
             "cached_tokens": 0},
            {"user": 0, "turn": 1, "kind": "chat", "ttft_s": 0.3, "total_s": 0.4, "prompt_tokens": 200,
             "cached_tokens": 180},
            {"user": 1, "turn": 1, "kind": "rag", "ttft_s": 0.2, "total_s": 0.4, "prompt_tokens": 100,
             "cached_tokens": 50},
            {"errors": ["user 2 turn 0: APIConnectionError"]}]
    s = summarize(rows, wall_s=2.0)
    assert (s["requests"], s["lost"]) == (3, 1)
    assert s["reuse_all"] == 230 / 400 and s["reuse_later_turns"] == 230 / 300
    assert (s["reuse_chat_later"], s["reuse_rag_later"]) == (0.9, 0.5)
    assert s["ttft_p50_ms"] == 200 and s["requests_per_s"] == 1.5
