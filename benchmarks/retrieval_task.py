"""The synthetic retrieval task shared by `train_retrieval.py` and `accuracy.py`.

A prompt is a system text, k fact chunks separated by ";" texts, and a question text last:

    [Text("facts :"), Chunk("the code of Bako is 417 ."), Text(";"), Chunk("Dimu works with Raso ."), ...,
     Text(";"), Text("code of Bako ?")]                                   -> answer "417"

- single hop: "code of NAME ?" -> the VALUE of "the code of NAME is VALUE ." among distractor chunks;
- two hop: "code of the partner of NAME1 ?" -> the VALUE of "the code of NAME2 is VALUE ." where another
  chunk says "NAME1 works with NAME2 ." (distractors include the code of NAME1 itself).

The tokenizer is word-level (one token per name and per value), so the answer is one token. Training uses
the same segment layout as the engine: BOS, then each segment tokenized on its own, concatenated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pc_rag

SYSTEM = "facts :"
SEP = ";"
WORDS = ["the", "code", "of", "is", ".", "works", "with", "partner", "?", "facts", ":", ";"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
N_NAMES = 128
N_VALUES = 64
TASKS = ("single", "two_hop")


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


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS + names() + values())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=128, clean_up_tokenization_spaces=False)


def code_fact(name: str, value: str) -> str:
    return f"the code of {name} is {value} ."


def works_fact(a: str, b: str) -> str:
    return f"{a} works with {b} ."


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
    """k fact chunks (k >= 2), shuffled; every name and value distinct within the prompt."""
    ns = rng.sample(name_list, 2 * k + 2)
    vs = rng.sample(value_list, k + 1)
    codes: dict[str, str] = {}
    works: list[tuple[str, str]] = []
    if task == "single":
        codes[ns[0]] = vs[0]
        question, answer = f"code of {ns[0]} ?", vs[0]
        free = 1
    else:
        a, b = ns[0], ns[1]
        works.append((a, b))
        codes[b] = vs[0]
        question, answer = f"code of the partner of {a} ?", vs[0]
        free = 2
        if k > 2 and rng.random() < 0.5:  # the code of the asked name itself: only the hop tells them apart
            codes[a] = vs[1]
    vi = 2
    while len(codes) + len(works) < k:
        if rng.random() < p_code:
            codes[ns[free]] = vs[vi]
            vi += 1
            free += 1
        else:
            works.append((ns[free], ns[free + 1]))
            free += 2
    facts = [code_fact(n, v) for n, v in codes.items()] + [works_fact(a, b) for a, b in works]
    rng.shuffle(facts)
    queries = [(f"code of {n} ?", v) for n, v in codes.items()]
    queries += [(f"code of the partner of {a} ?", codes[b]) for a, b in works if b in codes]
    queries = [q for q in queries if q[0] != question]
    rng.shuffle(queries)
    return Example(task, tuple(facts), question, answer, tuple([(question, answer)] + queries))


def token_ids(tokenizer, example: Example) -> list[int]:
    """What `pc_rag`'s SegmentTokenizer produces for `example.prompt()`: BOS, then each segment on its own."""
    ids = [tokenizer.bos_token_id]
    for seg in example.prompt():
        ids += tokenizer(seg.text, add_special_tokens=False)["input_ids"]
    return ids
