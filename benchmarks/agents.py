"""Agents: a tool-calling loop, each step's reuse next to its upper bound and its TTFT against `full`; and what a
JSON-schema grammar costs in decode speed.

    python -m benchmarks.agents [--model PATH] [--steps 5] [--out bench_out]

The loop: a system prompt, 3 tool schemas (a retriever tool whose results are documents, two others), a user
question; every step but the last is a forced call (the retriever tool on even steps, any tool on odd ones: the
offline bench model has random weights and never calls a tool by itself), answered by a tool message; the
retriever's documents are registered with the engine, as the framework hooks do when a retriever runs inside a
tool, so they are chunks wherever they reappear (the third step's search returns one document of the first's
again). Per step: prompt tokens, cached (reused) tokens, the upper bound (the tokens this prompt shares with the
previous request's prompt + reply, plus the documents beyond that which earlier prompts held), TTFT in `modular`
and in `full`.

Decode cost: the same prompt decoded free and under a JSON-schema grammar (an array of short strings, long
enough not to end early), interleaved, tokens per second after the first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pc_rag
from pc_rag.adapters import GenerationOptions, chat_request, stream_chat
from pc_rag.store import MemoryStore

from .common import common_prefix, model_or_bench

TOOLS = [
    {"type": "function", "function": {"name": "search_docs", "description": "Search the Python documentation.",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 16}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                                          "required": ["a", "b"]}}},
]
SYSTEM = "You are a helpful assistant for Python programmers. Use the tools to look things up before answering."


def documents(n: int = 3, chars: int = 600) -> list[str]:
    return [doc[:chars] for doc in pc_rag.testing.pydoc_corpus()[:n]]


def run_reply(engine, messages, mode, tool_choice, seed):
    options = GenerationOptions(mode=mode, max_new_tokens=120, temperature=1.0, seed=seed)
    request = chat_request(engine, messages, options, tools=TOOLS, tool_choice=tool_choice)
    *_, reply = stream_chat(engine, request)
    return reply


def agent_loop(model, tokenizer, steps: int) -> list[dict]:
    engine = pc_rag.Engine(model, tokenizer, store=MemoryStore())
    reference = pc_rag.Engine(model, tokenizer, store=MemoryStore())
    docs = documents()
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "How do I write a decorator that caches results?"}]
    rows, previous = [], None
    seen_docs: list[str] = []  # documents in the prompts of earlier steps (chunks the engine has encoded)
    new_docs: list[str] = []  # documents in the last tool result: first seen in this step's prompt
    for step in range(steps):
        # the retriever tool on even steps (its documents are the point), any tool on odd ones, text at the end
        choice = "none" if step == steps - 1 else "search_docs" if step % 2 == 0 else "required"
        reply = run_reply(engine, messages, "modular", choice, step)
        full = run_reply(reference, messages, "full", choice, step)
        gen = reply.generation
        prompt = list(gen.prompt_ids)
        bound = common_prefix(prompt, previous) if previous is not None else 0
        tail = engine.tokenizer.decode(prompt[bound:])
        bound += sum(len(engine.segmenter.ids(d)) * tail.count(d) for d in seen_docs)
        rows.append({"step": step + 1, "prompt_tokens": gen.prompt_tokens, "cached_tokens": gen.cached_tokens,
                     "upper_bound": min(bound, gen.prompt_tokens), "ttft_s": gen.ttft_s,
                     "full_ttft_s": full.generation.ttft_s, "call": [c.name for c in reply.tool_calls]})
        seen_docs += [d for d in new_docs if d not in seen_docs]
        previous = prompt + list(gen.token_ids)
        if not reply.tool_calls:
            break
        call = reply.tool_calls[0]
        if call.name == "search_docs":
            found = [docs[step % len(docs)], docs[(step + 1) % len(docs)]]  # step 3 returns docs[0] again
            engine.register(found)  # what the retriever hook does when the tool's retriever runs
            result = "\n\n".join(found)
            new_docs = found
        else:
            result = json.dumps({"ok": True, "step": step})
            new_docs = []
        messages = messages + [{"role": "assistant", "content": reply.content, "tool_calls": [call.openai()]},
                               {"role": "tool", "tool_call_id": call.id, "content": result}]
    return rows


def decode_cost(model, tokenizer, tokens: int, reps: int) -> dict:
    engine = pc_rag.Engine(model, tokenizer, store=MemoryStore())
    schema = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": tokens,
              "maxItems": tokens}
    grammar = pc_rag.Grammar.json_schema(schema)
    prompt = "Write the list as JSON:\n"
    engine.generate(prompt, max_new_tokens=4, grammar=grammar)  # compile once, outside the timing
    speeds = {"free": [], "json_schema": []}
    for rep in range(reps):
        for name, g in (("free", None), ("json_schema", grammar)):
            t0 = time.perf_counter()
            gen = engine.generate(prompt, max_new_tokens=tokens, grammar=g, temperature=1.0, seed=rep)
            wall = time.perf_counter() - t0
            speeds[name].append((len(gen.token_ids) - 1) / max(wall - gen.ttft_s, 1e-9))
    free, constrained = statistics.median(speeds["free"]), statistics.median(speeds["json_schema"])
    return {"tokens": tokens, "reps": reps, "free_tok_s": free, "json_schema_tok_s": constrained,
            "ratio": constrained / free}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint (default: the offline bench Llama, built once)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    base = pc_rag.Engine.from_pretrained(str(model_or_bench(args.model, args.out)), store=MemoryStore())
    model, tokenizer = base.model, base.tokenizer
    rows = agent_loop(model, tokenizer, args.steps)
    cost = decode_cost(model, tokenizer, args.decode_tokens, args.reps)
    print("| step | call | prompt tokens | cached | upper bound | TTFT modular | TTFT full |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {', '.join(r['call']) or 'text'} | {r['prompt_tokens']} | {r['cached_tokens']} | "
              f"{r['upper_bound']} | {r['ttft_s'] * 1e3:.0f} ms | {r['full_ttft_s'] * 1e3:.0f} ms |")
    print(f"\ndecode, {cost['tokens']} tokens, median of {cost['reps']}: free {cost['free_tok_s']:.1f} tok/s, "
          f"JSON schema {cost['json_schema_tok_s']:.1f} tok/s ({cost['ratio']:.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agents.json").write_text(json.dumps({"steps": rows, "decode": cost}, indent=1))


if __name__ == "__main__":
    main()
