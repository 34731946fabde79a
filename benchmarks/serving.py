"""A RAG service's trace, and what the memory tier's replacement policy keeps of it.

    python -m benchmarks.serving [--out DIR] [--chunks 1200] [--requests 4000] [--budget 0.2]

The trace (`rag_trace`): a corpus of chunks cut from Python's documentation (~250 tokens each), document
popularity drawn from a Zipf law (alpha 0.8 and 1.1), 4-8 retrieved chunks per question, each question's chunks
in a shuffled order, Poisson arrivals (`arrivals`), and some multi-turn conversations (a question sent again with
one more turn).

Eviction (`eviction`): the memory tier as the engine uses it (a lookup per chunk; a miss is encoded or read from
disk, then put) at a byte budget of `--budget` of the corpus' KV, for each policy of `pc_rag.store.memory`
(POLICIES): the share of the requests' chunk tokens found in memory. Block sizes follow each chunk's tokens (the
tensors are small stand-ins: a policy sees only sizes, keys and the order of uses), beside two bounds no policy
can pass (`bounds`). Prints a table, writes serving.json: `eviction.<policy>.<alpha>.hit_ratio`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pc_rag.blocks import KVBlock
from pc_rag.store.memory import POLICIES, MemoryStore

TOKENS_PER_WORD = 1.3  # the bench tokenizer on Python's documentation, near enough for sizes


@dataclass(frozen=True)
class Request:
    t_s: float  # arrival time
    chunks: tuple[int, ...]  # corpus indexes, in prompt order
    question: str
    turn: int  # 0: a new question; > 0: a follow-up in the same conversation


def corpus_chunks(n: int, words_per_chunk: int = 190) -> list[str]:
    """`n` chunks of Python's documentation, ~250 tokens each, in the order of its topics (repeated if short)."""
    from pydoc_data.topics import topics

    words = " ".join(" ".join(topics[k].split()) for k in sorted(topics)).split(" ")
    chunks = [" ".join(words[i: i + words_per_chunk]) for i in range(0, len(words) - words_per_chunk, words_per_chunk)]
    return [chunks[i % len(chunks)] + ("" if i < len(chunks) else f" ({i // len(chunks)})") for i in range(n)]


def rag_trace(n_chunks: int, n_requests: int, alpha: float, seed: int = 0, follow_ups: float = 0.1) -> list[Request]:
    """Questions over a corpus of `n_chunks` with Zipf(`alpha`) document popularity: each retrieves 4-8 chunks,
    drawn by popularity without repeats, in a random order; a `follow_ups` share continues an earlier question."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** alpha for rank in range(n_chunks)]
    ranks = list(range(n_chunks))
    rng.shuffle(ranks)  # popularity independent of corpus order
    out: list[Request] = []
    for i in range(n_requests):
        if out and rng.random() < follow_ups:
            prev = rng.choice(out[-50:])
            out.append(Request(0.0, prev.chunks, prev.question + " And then?", prev.turn + 1))
            continue
        k = rng.randint(4, 8)
        picked: list[int] = []
        while len(picked) < k:
            c = ranks[rng.choices(range(n_chunks), weights)[0]]
            if c not in picked:
                picked.append(c)
        out.append(Request(0.0, tuple(picked), f"Question {i}: what does the documentation say about it?", 0))
    return out


def arrivals(trace: list[Request], rate_rps: float, seed: int = 0) -> list[Request]:
    """The trace with Poisson arrival times at `rate_rps`."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in trace:
        t += rng.expovariate(rate_rps)
        out.append(Request(t, r.chunks, r.question, r.turn))
    return out


def _block(tokens: int, layers: int = 2) -> KVBlock:
    k = torch.zeros(layers, 1, tokens, 1)
    return KVBlock(k, k, tuple(range(tokens)), 0)


def eviction(chunks: list[str], trace: list[Request], budget: float, policy: str) -> dict:
    tokens = [max(1, round(len(c.split(" ")) * TOKENS_PER_WORD)) for c in chunks]
    size = _block(1).nbytes
    total = sum(tokens) * size
    store = MemoryStore(max_bytes=int(budget * total), policy=policy)
    hit = asked = 0
    for r in trace:
        for c in r.chunks:
            key = f"chunk-{c:040x}"
            asked += tokens[c]
            if store.get(key) is not None:
                hit += tokens[c]
            else:
                store.put(key, _block(tokens[c]))
    return {"hit_ratio": hit / asked, "evictions": store.tier_stats()[0].evictions}


def bounds(chunks: list[str], trace: list[Request], budget: float, alpha: float) -> dict:
    """What no policy can beat on this trace: "static", the chunks most popular by the trace's own Zipf law kept
    for good (the best any frequency-based policy can learn); "belady", a clairvoyant that, when a block must
    leave, drops the one used again farthest in the future (Belady's MIN, by uses, not sizes: an upper bound
    within a few points for blocks of near-equal size)."""
    tokens = [max(1, round(len(c.split(" ")) * TOKENS_PER_WORD)) for c in chunks]
    cap = budget * sum(tokens)
    asked = sum(tokens[c] for r in trace for c in r.chunks)
    counts: dict[int, int] = {}
    for r in trace:
        for c in r.chunks:
            counts[c] = counts.get(c, 0) + 1
    kept, used = set(), 0
    for c in sorted(counts, key=lambda c: -counts[c]):
        if used + tokens[c] <= cap:
            kept.add(c)
            used += tokens[c]
    static = sum(tokens[c] for r in trace for c in r.chunks if c in kept) / asked
    uses = [c for r in trace for c in r.chunks]
    following: list[int] = [0] * len(uses)
    last: dict[int, int] = {}
    for i in range(len(uses) - 1, -1, -1):
        following[i] = last.get(uses[i], len(uses))
        last[uses[i]] = i
    held: dict[int, int] = {}  # chunk -> index of its next use
    used = hit = 0
    for i, c in enumerate(uses):
        if c in held:
            hit += tokens[c]
        else:
            used += tokens[c]
        held[c] = following[i]
        while used > cap:
            out = max(held, key=held.get)
            used -= tokens[out]
            del held[out]
    return {"static": static, "belady": hit / asked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--chunks", type=int, default=1200)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chunks = corpus_chunks(args.chunks)
    result = {"chunks": args.chunks, "requests": args.requests, "budget": args.budget, "eviction": {}}
    print(f"memory tier at {args.budget:.0%} of the corpus' KV; share of chunk tokens found in memory")
    print("alpha  " + "  ".join(f"{p:>6}" for p in POLICIES) + "  static  belady   (bounds: no policy does better)")
    for alpha in (0.8, 1.1):
        trace = rag_trace(args.chunks, args.requests, alpha, args.seed)
        row = {p: eviction(chunks, trace, args.budget, p) for p in POLICIES}
        for p, r in row.items():
            result["eviction"].setdefault(p, {})[str(alpha)] = r
        limit = bounds(chunks, trace, args.budget, alpha)
        result.setdefault("eviction_bounds", {})[str(alpha)] = limit
        print(f"{alpha:<5}  " + "  ".join(f"{row[p]['hit_ratio']:6.3f}" for p in POLICIES)
              + f"  {limit['static']:6.3f}  {limit['belady']:6.3f}")
    (out / "serving.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
