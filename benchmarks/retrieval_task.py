"""The synthetic retrieval task shared by `train_retrieval.py` and `accuracy.py`.

A prompt is a system text, k fact chunks separated by ";" texts, and a question text last:

    [Text("facts :"), Chunk("417 is the code of Bako ."), Text(";"), Chunk("Raso works with Dimu ."), ...,
     Text(";"), Text("what is the code of Bako")]                          -> answer "417"

- single hop: "what is the code of NAME" -> the VALUE of "VALUE is the code of NAME ." among distractors;
- two hop: "what is the code of the partner of NAME1" -> the VALUE of "VALUE is the code of NAME2 ." where
  another chunk says "NAME2 works with NAME1 ." (distractors include the code of NAME1 itself);
- alias (a chunk that needs an earlier one): "what is the code of NAME" -> the VALUE of "VALUE is the code of
  ALIAS .", where an earlier chunk (always earlier) says "ALIAS is the alias of NAME .". The chunk holding the
  value names an entity only the earlier chunk defines: in a full prefill its tokens can resolve the alias in
  place, encoded alone (modular) they cannot, and the question must make both hops. Distractors: codes of other
  names, other aliases (some with a code of their own), partners.

The tokenizer is word-level (one token per name and per value), so the answer is one token. Training uses
the same segment layout as the engine: BOS, then each segment tokenized on its own, concatenated.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, replace
from functools import cache

import pc_rag

SYSTEM = "facts :"
SEP = ";"
WORDS = ["the", "code", "of", "is", ".", "works", "with", "partner", "?", "facts", ":", ";", "what"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
N_NAMES = 128
N_VALUES = 64
TASKS = ("single", "two_hop")  # what the 4-layer model learned; the defaults of training and of the benchmark
ALL_TASKS = (*TASKS, "alias")
ALIAS_WORDS = ["alias"]  # appended after the values, so the first two tasks keep their token ids


def names() -> list[str]:
    syll = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    rng = random.Random(1234)
    out: list[str] = []
    seen = set()
    while len(out) < N_NAMES:
        n = (rng.choice(syll) + rng.choice(syll)).capitalize()
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


def values() -> list[str]:
    rng = random.Random(4321)
    return [str(v) for v in sorted(rng.sample(range(100, 1000), N_VALUES))]


def build_tokenizer(tasks=TASKS, prose: bool = False):
    """The word-level tokenizer of `tasks`: the alias task adds its word at the end of the vocabulary, and the
    long-chunk testbed (`prose`) the words of its prose after that."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = (ALIAS_WORDS if "alias" in tasks else []) + (prose_words() if prose else [])
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS + names() + values() + extra)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=2048 if prose else 128,
                                   clean_up_tokenization_spaces=False)


# The name comes last in a fact and in a question: the question's last token is the name itself, and a fact's
# name token can take its value (or partner) from a fixed offset before it. Associative recall then needs one
# learned offset head instead of two, which is what got past the loss plateau on a CPU budget.
def code_fact(name: str, value: str) -> str:
    return f"{value} is the code of {name} ."


def works_fact(a: str, b: str) -> str:
    """b is a's partner."""
    return f"{b} works with {a} ."


def alias_fact(alias: str, name: str) -> str:
    """`alias` names `name` (the name last, as in the other facts)."""
    return f"{alias} is the alias of {name} ."


def code_question(name: str) -> str:
    return f"what is the code of {name}"


def partner_question(name: str) -> str:
    return f"what is the code of the partner of {name}"


@dataclass(frozen=True)
class Example:
    task: str
    chunks: tuple[str, ...]
    question: str
    answer: str
    # every question the chunks answer (the asked one first): training asks several per prompt
    queries: tuple[tuple[str, str], ...] = ()

    def prompt(self) -> list:
        p: list = [pc_rag.Text(SYSTEM)]
        for i, c in enumerate(self.chunks):
            if i:
                p.append(pc_rag.Text(SEP))
            p.append(pc_rag.Chunk(c))
        p += [pc_rag.Text(SEP), pc_rag.Text(self.question)]
        return p


def make_example(rng: random.Random, task: str, k: int, name_list: list[str], value_list: list[str],
                 p_code: float = 0.6) -> Example:
    """k fact chunks (k >= 2), shuffled (an alias always before the code that uses it); every name and value
    distinct within the prompt."""
    ns = rng.sample(name_list, 2 * k + 2)
    vs = rng.sample(value_list, k + 1)
    codes: dict[str, str] = {}
    works: list[tuple[str, str]] = []
    aliases: list[tuple[str, str]] = []  # (alias, name)
    if task == "alias":
        name, alias = ns[0], ns[1]
        aliases.append((alias, name))
        codes[alias] = vs[0]
        question, answer = code_question(name), vs[0]
        free = 2
    elif task == "single":
        codes[ns[0]] = vs[0]
        question, answer = code_question(ns[0]), vs[0]
        free = 1
    else:
        a, b = ns[0], ns[1]
        works.append((a, b))
        codes[b] = vs[0]
        question, answer = partner_question(a), vs[0]
        free = 2
        if k > 2 and rng.random() < 0.5:  # the code of the asked name itself: only the hop tells them apart
            codes[a] = vs[1]
    vi = 2
    while len(codes) + len(works) + len(aliases) < k:
        # (the first test keeps the other tasks' random stream as it was before the alias task existed)
        if task == "alias" and rng.random() < 0.4:
            aliases.append((ns[free], ns[free + 1]))
            if len(codes) + len(works) + len(aliases) < k and rng.random() < 0.5:  # an alias with a code of its own
                codes[ns[free]] = vs[vi]
                vi += 1
            free += 2
        elif rng.random() < p_code:
            codes[ns[free]] = vs[vi]
            vi += 1
            free += 1
        else:
            works.append((ns[free], ns[free + 1]))
            free += 2
    facts = [code_fact(n, v) for n, v in codes.items()] + [works_fact(a, b) for a, b in works]
    facts += [alias_fact(a, n) for a, n in aliases]
    rng.shuffle(facts)
    for a, n in aliases:  # the definition before its use
        if a in codes:
            i, j = facts.index(alias_fact(a, n)), facts.index(code_fact(a, codes[a]))
            if j < i:
                facts[i], facts[j] = facts[j], facts[i]
    queries = [(code_question(n), v) for n, v in codes.items()]
    queries += [(partner_question(a), codes[b]) for a, b in works if b in codes]
    queries += [(code_question(n), codes[a]) for a, n in aliases if a in codes]
    queries = [q for q in queries if q[0] != question]
    rng.shuffle(queries)
    return Example(task, tuple(facts), question, answer, tuple([(question, answer)] + queries))


def token_ids(tokenizer, example: Example) -> list[int]:
    """What `pc_rag`'s SegmentTokenizer produces for `example.prompt()`: BOS, then each segment on its own."""
    ids = [tokenizer.bos_token_id]
    for seg in example.prompt():
        ids += tokenizer(seg.text, add_special_tokens=False)["input_ids"]
    return ids


# The long-chunk testbed: each fact sits at a random place inside prose, so that a chunk is 64-256 tokens as
# documents in RAG are, and what one chunk needs from another is a small part of it. The prose is Python's
# documentation (pydoc_data.topics, shipped with Python) reduced to its commonest words, none of them a word of the
# facts or questions (so no prose can read as a fact), one token each.
PROSE_WORDS = 384


@cache
def prose_words() -> list[str]:
    from pydoc_data.topics import topics

    taken = set(WORDS) | set(ALIAS_WORDS)
    counts = Counter(w for k in sorted(topics) for w in re.findall(r"[a-z]+", topics[k].lower()) if w not in taken)
    return sorted(w for w, _ in counts.most_common(PROSE_WORDS))


@cache
def prose_stream() -> tuple[str, ...]:
    """The documentation's words in order, those outside the prose vocabulary left out."""
    from pydoc_data.topics import topics

    keep = set(prose_words())
    return tuple(w for k in sorted(topics) for w in re.findall(r"[a-z]+", topics[k].lower()) if w in keep)


def in_prose(rng: random.Random, example: Example, lo: int, hi: int) -> Example:
    """`example` with each fact chunk grown to lo-hi words (one token each) by a window of prose around it, the
    fact at a random place inside."""
    stream = prose_stream()
    chunks = []
    for fact in example.chunks:
        words = fact.split()
        n = max(0, rng.randint(lo, hi) - len(words))
        start = rng.randrange(len(stream) - n)
        filler = list(stream[start:start + n])
        cut = rng.randint(0, n)
        chunks.append(" ".join(filler[:cut] + words + filler[cut:]))
    return replace(example, chunks=tuple(chunks))


def chunk_tokens_of(model) -> tuple[int, int] | None:
    """The chunk lengths a testbed model was trained on (its training_log.json), None for one-sentence chunks."""
    import json
    from pathlib import Path

    log = Path(model) / "training_log.json"
    record = json.loads(log.read_text()) if log.exists() else {}
    while record and not record.get("args", {}).get("chunk_tokens"):
        record = record.get("tuned_from_record") or {}
    lengths = record.get("args", {}).get("chunk_tokens") if record else None
    return tuple(lengths) if lengths else None
