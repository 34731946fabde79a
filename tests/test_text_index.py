"""ChunkIndex.split: reference is the segment list written out by hand for each prompt layout."""

import random
import time

import pytest

from pc_rag.errors import PCRagError
from pc_rag.segments import Chunk, Text
from pc_rag.text_index import ChunkIndex

DOC_A = "Paris is the capital of France. It lies on the Seine."
DOC_B = "The Rhine flows through Basel, Strasbourg and Cologne."


def joined(segments):
    return "".join(s.text for s in segments)


def test_unknown_prompt_is_one_text():
    index = ChunkIndex([DOC_A])
    assert index.split("What is the capital of Spain?") == [Text("What is the capital of Spain?")]
    assert ChunkIndex().split("") == [Text("")]


def test_langchain_stuff_chain_layout():
    # create_stuff_documents_chain: page_content joined with "\n\n", put into {context} of the prompt.
    index = ChunkIndex([DOC_A, DOC_B])
    prompt = f"Answer using the context.\n\nContext: {DOC_A}\n\n{DOC_B}\n\nQuestion: Where is Basel?"
    assert index.split(prompt) == [
        Text("Answer using the context.\n\nContext: "),
        Chunk(DOC_A),
        Text("\n\n"),
        Chunk(DOC_B),
        Text("\n\nQuestion: Where is Basel?"),
    ]


def test_llama_index_metadata_and_qa_template_layout():
    # node.get_content(MetadataMode.LLM): "key: value" lines, a blank line, then the text; nodes joined by
    # "\n\n" into the default text_qa_template.
    index = ChunkIndex([DOC_A, DOC_B])
    context = f"file_name: a.txt\n\n{DOC_A}\n\nfile_name: b.txt\n\n{DOC_B}"
    prompt = (
        "Context information is below.\n---------------------\n"
        f"{context}\n---------------------\n"
        "Given the context information and not prior knowledge, answer the query.\nQuery: Basel?\nAnswer: "
    )
    segments = index.split(prompt)
    assert [s for s in segments if isinstance(s, Chunk)] == [Chunk(DOC_A), Chunk(DOC_B)]
    assert segments[1] == Chunk(DOC_A) and segments[3] == Chunk(DOC_B)
    assert segments[2] == Text("\n\nfile_name: b.txt\n\n")
    assert joined(segments) == prompt


def test_registered_whitespace_is_stripped_so_trimmed_layouts_still_hit():
    # A loader left a trailing newline; the chat template trims message content, so the prompt has none.
    index = ChunkIndex()
    assert index.add("\n" + DOC_A + "\n")
    assert DOC_A in index and (" " + DOC_A) in index
    assert not index.add(DOC_A)  # same key
    assert not index.add("  \n ")  # whitespace only: nothing to match
    assert len(index) == 1
    assert index.split(f"user:\n{DOC_A}") == [Text("user:\n"), Chunk(DOC_A)]


def test_internal_whitespace_is_exact():
    index = ChunkIndex(["one two"])
    assert index.split("x one  two") == [Text("x one  two")]


def test_leftmost_longest_non_overlapping():
    index = ChunkIndex(["alpha beta", "alpha beta gamma", "gamma delta", "delta"])
    assert index.split("alpha beta gamma delta") == [
        Chunk("alpha beta gamma"),
        Text(" "),
        Chunk("delta"),
    ]
    # The leftmost match wins even when a later overlapping one is longer.
    index = ChunkIndex(["a b", "b c d e"])
    assert index.split("a b c d e") == [Chunk("a b"), Text(" c d e")]


def test_word_boundaries():
    index = ChunkIndex(["cat"])
    assert index.split("concatenate") == [Text("concatenate")]
    assert index.split("a cat.") == [Text("a "), Chunk("cat"), Text(".")]
    assert ChunkIndex(["cat"], word_boundaries=False).split("concat") == [Text("con"), Chunk("cat")]
    # A chunk ending in punctuation may touch the next word.
    assert ChunkIndex(["end."]).split("the end.Next") == [Text("the "), Chunk("end."), Text("Next")]


def test_adding_after_split_is_seen():
    index = ChunkIndex([DOC_A])
    assert index.split(DOC_B) == [Text(DOC_B)]
    index.add(DOC_B)
    assert index.split(DOC_B) == [Chunk(DOC_B)]
    assert index.split(f"{DOC_A} {DOC_B}") == [Chunk(DOC_A), Text(" "), Chunk(DOC_B)]


def test_bad_input_names_the_type():
    with pytest.raises(PCRagError, match="str"):
        ChunkIndex().add(3)
    with pytest.raises(PCRagError, match="str"):
        ChunkIndex().split(None)


def test_100k_chunks(capsys):
    # Scale check, no timing assert: 100,000 short registered chunks, a prompt of 40 of them plus text.
    rng = random.Random(0)
    words = ["river", "mountain", "city", "north", "bridge", "old", "green", "harbour", "market", "tower"]
    chunks = [f"doc {i}: " + " ".join(rng.choice(words) for _ in range(8)) + "." for i in range(100_000)]
    t0 = time.perf_counter()
    index = ChunkIndex(chunks)
    index.split("warm")  # the automaton is built on first use
    build_s = time.perf_counter() - t0
    picked = rng.sample(range(100_000), 40)
    prompt = "Context:\n" + "\n\n".join(chunks[i] for i in picked) + "\n\nQuestion: which tower?"
    t0 = time.perf_counter()
    segments = index.split(prompt)
    split_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.add_many(["a freshly retrieved document.", "another one."])
    index.split(prompt)
    add_split_s = time.perf_counter() - t0
    assert [s.text for s in segments if isinstance(s, Chunk)] == [chunks[i] for i in picked]
    assert joined(segments) == prompt
    with capsys.disabled():
        print(
            f"\n100k chunks: build {build_s:.2f} s, split of {len(prompt)} chars {split_s * 1e3:.2f} ms, "
            f"add 2 + split {add_split_s * 1e3:.2f} ms"
        )


def test_a_discovery_notifies_and_serves_only_the_engines_watching_it():
    """Reference: which stand-in engines were asked to prefetch, and which index finds the text afterwards."""
    from pc_rag.text_index import Discovery

    class Watcher:
        prefetch_on_discover = True

        def __init__(self):
            self.asked = []

        def prefetch(self, texts):
            self.asked.append(list(texts))

    mine, other = Discovery(), Discovery()
    a, b = Watcher(), Watcher()
    mine.watch(a)
    other.watch(b)
    assert mine.discover([DOC_A]) == 1 and mine.discover([DOC_A]) == 0
    assert a.asked == [[DOC_A], [DOC_A]] and b.asked == []
    text = "Context: " + DOC_A
    assert [(s.start, s.end) for s in mine.candidates(text)] == [(9, 9 + len(DOC_A))]
    assert other.candidates(text) == []
