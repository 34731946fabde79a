"""Adapt a trained retrieval model to modular reuse (Block-Attention, Sun et al., ICLR 2025), on CPU.

    python -m benchmarks.block_tune --model benchmarks/deep-retrieval-model --out benchmarks/deep-retrieval-block

Modular reuse hands the model chunks it never saw together: each chunk's KV was computed after BOS alone, then its
keys were rotated to the chunk's place in the prompt. A model trained only with full attention has never met
such a cache, so the question's attention over it goes wrong in ways that no selection of recomputed tokens fully
repairs (docs/results.md). Block-Attention trains the model on that very cache, mixed with full attention so that
full prefill keeps its quality.

**The block layout is what pc_rag computes, as one masked forward** (`block_layout`): every chunk is preceded by a
copy of BOS placed at the position just before the chunk's first token, and only that chunk attends to it; a chunk
token attends to its copy and to its own chunk's earlier tokens; every other token (the system text, the ";"
texts, the question, the training's extra questions) attends to every earlier token except the copies. Under RoPE
attention depends on positions only through their differences, so a chunk token at position p sees its copy at
distance p - (start - 1), which is what it saw encoded alone after BOS at position 0, and the question sees the
chunk's keys at their place in the prompt, which is where pc_rag rotates them. A test
(tests/test_benchmarks.py) checks this forward's answer logits against `Engine.next_token_logits(mode="modular")`.

Recipe: the task's own loss (the answer tokens, as `train_retrieval.py`), each batch half block layout and half
full attention (`--block-share`), 2-6 chunks per prompt, AdamW from the trained checkpoint at a low learning rate
with a cosine decay. All weights are tuned: the testbed models are small enough (5.6M parameters) that the result
is an ordinary checkpoint that pc_rag loads as any other, and its fingerprint is its weights'. Seeded, one
--threads: reproducible. Writes the checkpoint and training_log.json (held-out accuracy of both layouts, computed
by this forward, at every evaluation) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

import pc_rag

from .retrieval_task import ALL_TASKS, TASKS, build_tokenizer, chunk_tokens_of, in_prose, make_example, names, values

FRESH, COPY = -1, -2  # block ids of tokens computed in context and of the BOS copies; chunks are 0, 1, ...


def block_layout(vocab: dict[str, int], bos: int, example, n_queries: int = 1, rng: random.Random | None = None,
                 block: bool = True):
    """The prompt's training row: (ids, positions, blocks, targets). With block=False it is the plain causal row
    (positions 0..n-1, every token FRESH); with block=True each chunk gets its BOS copy (block COPY, owner in the
    next token) and its tokens the chunk's index. Extra questions after the first answer, as in
    `train_retrieval.encode_queries`, are FRESH: computed in context, as pc_rag computes a question."""
    ids, pos, blocks = [bos], [0], [FRESH]
    n_chunk = 0
    for seg in example.prompt():
        words = [vocab[w] for w in seg.text.split()]
        start = sum(b != COPY for b in blocks)  # the next position in the prompt
        if isinstance(seg, pc_rag.Chunk) and block:
            ids.append(bos)
            pos.append(start - 1)
            blocks.append(COPY)
            tag = n_chunk
            n_chunk += 1
        else:
            tag = FRESH
        ids += words
        pos += range(start, start + len(words))
        blocks += [tag] * len(words)
    targets = [(len(ids) - 1, vocab[example.answer])]
    for _ in range(n_queries - 1):
        question, answer = rng.choice(example.queries)
        extra = [targets[-1][1], vocab[";"]] + [vocab[w] for w in question.split()]
        ids += extra
        pos += range(pos[-1] + 1, pos[-1] + 1 + len(extra))
        blocks += [FRESH] * len(extra)
        targets.append((len(ids) - 1, vocab[answer]))
    return ids, pos, blocks, targets


def allowed(blocks: list[int]) -> torch.Tensor:
    """[n, n] bool: may row i attend to column j (see the module docstring)."""
    b = torch.tensor(blocks)
    n = len(blocks)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    owner = b.clone()  # a copy belongs to the chunk whose first token follows it
    copies = (b == COPY).nonzero().flatten()
    owner[copies] = b[copies + 1]
    row, col = b[:, None], b[None, :]
    fresh_row = (row == FRESH) & (col != COPY)
    chunk_row = (row >= 0) & (owner[None, :] == row) & ((col == row) | (col == COPY))
    copy_row = torch.eye(n, dtype=torch.bool) & (row == COPY)
    return causal & (fresh_row | chunk_row | copy_row)


def batch(rows):
    """Right-padded ids, positions, and an additive [batch, 1, n, n] mask; pad rows attend to themselves."""
    n = max(len(r[0]) for r in rows)
    x = torch.zeros(len(rows), n, dtype=torch.long)
    p = torch.zeros(len(rows), n, dtype=torch.long)
    ok = torch.eye(n, dtype=torch.bool).repeat(len(rows), 1, 1)
    for i, (ids, pos, blocks, _) in enumerate(rows):
        m = len(ids)
        x[i, :m], p[i, :m] = torch.tensor(ids), torch.tensor(pos)
        ok[i, :m, :m] = allowed(blocks)
    mask = torch.zeros(ok.shape, dtype=torch.float32).masked_fill(~ok, torch.finfo(torch.float32).min)
    return x, p, mask[:, None]


def answer_logits(model, rows):
    x, p, mask = batch(rows)
    h = model.model(input_ids=x, position_ids=p, attention_mask=mask).last_hidden_state
    ri = torch.tensor([i for i, r in enumerate(rows) for _ in r[3]])
    pi = torch.tensor([t for r in rows for t, _ in r[3]])
    return model.lm_head(h[ri, pi]), torch.tensor([a for r in rows for _, a in r[3]])


@torch.no_grad()
def accuracy(model, rows) -> float:
    model.eval()
    right = 0
    for i in range(0, len(rows), 128):
        logits, answers = answer_logits(model, rows[i:i + 128])
        right += int((logits.argmax(-1) == answers).sum())
    model.train()
    return right / len(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/deep-retrieval-model", help="the trained checkpoint to adapt")
    ap.add_argument("--out", default="benchmarks/deep-retrieval-block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", nargs="+", choices=list(ALL_TASKS), help="default: the checkpoint's")
    ap.add_argument("--block-share", type=float, default=0.5, help="fraction of each batch in the block layout")
    ap.add_argument("--chunks", type=int, nargs=2, default=[2, 6], metavar=("LO", "HI"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--queries", type=int, default=6, help="questions per training sequence (the first is scored)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--max-minutes", type=float, default=60.0, help="safety stop (not part of the determinism)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-n", type=int, default=256, help="held-out prompts per task and chunk count")
    ap.add_argument("--eval-chunks", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it, bit for bit)")
    ap.add_argument("--bf16", action="store_true", help="training forward and backward under bf16 autocast (the "
                    "weights and the optimizer stay fp32; evaluations run in fp32)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    lengths = chunk_tokens_of(args.model)  # the long-chunk testbed's chunks are facts inside prose
    prose = lengths is not None
    known = ALL_TASKS if model.config.vocab_size == len(build_tokenizer(ALL_TASKS, prose=prose)) else TASKS
    tasks = tuple(t for t in ALL_TASKS if t in (args.tasks or known))  # (alias has a word of its own)
    args.tasks = list(tasks)
    tok = build_tokenizer(tasks, prose=prose)
    if len(tok) != model.config.vocab_size:
        raise SystemExit(f"--model {args.model}: vocabulary {model.config.vocab_size} != the tasks' {len(tok)}")
    vocab, bos = tok.get_vocab(), tok.bos_token_id
    name_list, value_list = names(), values()

    def example(rng, task, k, **kw):
        ex = make_example(rng, task, k, name_list, value_list, **kw)
        return in_prose(rng, ex, *lengths) if prose else ex

    eval_rng = random.Random(20_000 + args.seed)  # held-out: a stream apart from training's and the benchmarks'
    held = {(t, k): [example(eval_rng, t, k) for _ in range(args.eval_n)] for k in args.eval_chunks for t in tasks}

    def evaluate() -> dict:
        return {f"{layout} {t} {k}": round(accuracy(model, [block_layout(vocab, bos, ex, block=layout == "block")
                                                             for ex in exs]), 4)
                for layout in ("full", "block") for (t, k), exs in held.items()}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    log = [{"step": 0, "minutes": 0.0, "loss": None, "accuracy": evaluate()}]
    print(json.dumps(log[-1]), flush=True)
    rng = random.Random(args.seed)
    n_block = round(args.batch * args.block_share)
    t0, loss_sum = time.time(), 0.0
    model.train()
    for step in range(1, args.steps + 1):
        rows = []
        for i in range(args.batch):
            ex = example(rng, tasks[i % len(tasks)], rng.randint(*args.chunks), p_code=0.75)
            rows.append(block_layout(vocab, bos, ex, args.queries, rng, block=i < n_block))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits, answers = answer_logits(model, rows)
        loss = torch.nn.functional.cross_entropy(logits.float(), answers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_sum += float(loss.detach())
        minutes = (time.time() - t0) / 60
        if step % args.eval_every == 0 or step == args.steps or minutes > args.max_minutes:
            log.append({"step": step, "minutes": round(minutes, 2), "loss": round(loss_sum / args.eval_every, 4),
                        "accuracy": evaluate()})
            loss_sum = 0.0
            print(json.dumps(log[-1]), flush=True)
            model.save_pretrained(out)
            record = {"args": vars(args), "argv": list(argv if argv is not None else sys.argv[1:]), "log": log}
            if (Path(args.model) / "training_log.json").exists():  # the tuned model keeps its whole history
                record["tuned_from_record"] = json.loads((Path(args.model) / "training_log.json").read_text())
            (out / "training_log.json").write_text(json.dumps(record, indent=1))
            if minutes > args.max_minutes:
                break
    print(f"saved {out} after {step} steps, {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
