"""Cache namespaces (`cache_salt=`, issue 24): a request reuses only what requests of its own namespace stored, and
public chunks; without a namespace every key is what it was before namespaces.

References: keys computed by the code before namespaces (literal digests below, from commit a4d551e's blocks.py);
a fresh engine's counts for the same prompt (a request of another namespace must see exactly what a first request
sees: no token cached); the same engine's counts without a namespace (reuse within one namespace unchanged); the
tokenization of a prompt string in an engine that never generated the reply inside it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pc_rag
from pc_rag import Chunk, OptionError, OptionTypeError, Text
from pc_rag.blocks import chunk_key, link_key, prefix_key, root_key, scaffold_key
from pc_rag.prefix import BLOCK_TOKENS, extent_key, run_blocks
from pc_rag.store import DiskStore, MemoryStore, RedisStore, TieredStore

from .conftest import worktree_env


def system_text() -> str:
    from pydoc_data.topics import topics

    return topics["for"][:1500] + "\n\nThe secret word is swordfish.\n"


def doc_prompt(doc: str, system: str = "Answer from the documents.\n\n", tail: str = "\n\nQuestion: what?\n"):
    return [Text(system), Chunk(doc), Text(tail)]


def fresh(loaded, store=None) -> pc_rag.Engine:
    model, tok = loaded
    return pc_rag.Engine(model, tok, store=store if store is not None else MemoryStore())


# ---- keys, without a model -------------------------------------------------------------------------------------
def test_keys_without_a_namespace_are_the_keys_of_earlier_versions():
    fp = "fp0123"
    # Digests computed with blocks.py as of a4d551e (before namespaces): caches written then keep working.
    assert chunk_key(fp, (5, 6, 7), (1,), 1) == "chunk-1d36e93b1f6b213062b8fafe78a203213e42e477"
    assert chunk_key(fp, (5, 6, 7), (1,), 1, None) == chunk_key(fp, (5, 6, 7), (1,), 1)
    assert scaffold_key(fp, [(5, 6), (9,), (7, 8)], (1,), 1) == "scaffold-01663ddbddb0bcd022d7d52919d4b7a2d61f8a5b"
    assert root_key(fp) == "root-fp0123"
    assert prefix_key(fp, root_key(fp), (1, 2), (0, 1)) == "prefix-13d9b10f11109f250363f6c2f0dc4ba284ab563e"


def test_a_namespace_changes_every_key_and_two_namespaces_differ():
    fp = "fp0123"
    ids, pos = list(range(3 * BLOCK_TOKENS)), list(range(3 * BLOCK_TOKENS))
    by_ns = {}
    for ns in (None, "alpha", "beta", "alpha/x"):
        blocks = run_blocks(fp, root_key(fp, ns), ids, pos, 0, len(ids), True)
        by_ns[ns] = {chunk_key(fp, (5, 6), (1,), 1, ns), scaffold_key(fp, [(5,), (6,)], (1,), 1, ns),
                     root_key(fp, ns), extent_key(blocks[-1].key), link_key(blocks[0].key, "chunk-x", 3),
                     *(b.key for b in blocks)}
    everything = [k for keys in by_ns.values() for k in keys]
    assert len(everything) == len(set(everything))  # no key is shared by two namespaces


def test_a_servers_namespaces_are_its_tenants_narrowed_by_salts():
    """`tenant_namespace`: one namespace per (tenant, salt) pair, none equal to a salt as a client sends it or to
    another pair's; no tenant and no salt: no namespace (what `pc-rag warm` and salt-less engine calls use)."""
    from pc_rag.blocks import tenant_namespace

    assert tenant_namespace(None) is None and tenant_namespace(None, None) is None
    pairs = [(t, s) for t in (None, "alpha", "beta", "alpha-x") for s in (None, "s1", "s2", "alpha", "x" * 256)]
    names = [tenant_namespace(t, s) for t, s in pairs if (t, s) != (None, None)]
    assert len(set(names)) == len(names)
    assert not {s for _, s in pairs} & set(names)  # a client's salt is never used as it is
    assert {len(n) for n in names} <= {45, 47} and all(pc_rag.GenerationOptions(cache_salt=n) for n in names)
    assert tenant_namespace("alpha", "s1") == tenant_namespace("alpha", "s1")


def test_a_salt_is_checked_at_the_call(engine):
    for bad, error in (("", OptionError), ("x" * 257, OptionError), ("a\ud800", OptionError), (5, OptionTypeError),
                       (b"alpha", OptionTypeError)):
        with pytest.raises(error, match="cache_salt"):
            engine.stream("hello", cache_salt=bad)  # before the first next()
        with pytest.raises(error, match="cache_salt"):
            engine.explain("hello", cache_salt=bad)
        with pytest.raises(error, match="cache_salt"):
            engine.split("hello", cache_salt=bad)
    assert pc_rag.GenerationOptions(cache_salt="x" * 256).cache_salt == "x" * 256


# ---- the engine ------------------------------------------------------------------------------------------------
def test_without_a_salt_an_engine_stores_the_keys_of_earlier_versions(loaded, docs):
    engine = fresh(loaded)
    g = engine.generate(doc_prompt(docs[0]), max_new_tokens=2)
    fp, bos = engine.runner.fingerprint, engine.segmenter.bos_id
    bos_and_system, chunk = engine.segmenter.segments(doc_prompt(docs[0]))[1:3]
    assert engine.store.contains(chunk_key(fp, chunk.token_ids, (bos,), 1))  # encoded right after BOS
    # the first prefix block: BOS and the system text, chained from "root-" + fingerprint
    n = min(BLOCK_TOKENS, bos_and_system.end)
    assert engine.store.contains(prefix_key(fp, "root-" + fp, g.prompt_ids[:n], tuple(range(n))))
    # cache_salt=None is no namespace: the same keys, so the second request reuses the first one's
    again = engine.generate(doc_prompt(docs[0]), max_new_tokens=2, cache_salt=None)
    assert again.cached_tokens == again.prompt_tokens - 1


@pytest.mark.parametrize("mode", ["exact", "modular"])
def test_another_namespace_reuses_nothing_its_own_reuses_as_before(loaded, docs, mode):
    prompt = system_text() + "\n\nUser: what is the secret word?\nAssistant:"
    reference = fresh(loaded)
    first = reference.generate(prompt, mode=mode, max_new_tokens=4)
    second = reference.generate(prompt, mode=mode, max_new_tokens=4)
    engine = fresh(loaded)
    a1 = engine.generate(prompt, mode=mode, max_new_tokens=4, cache_salt="alpha")
    a2 = engine.generate(prompt, mode=mode, max_new_tokens=4, cache_salt="alpha")
    assert (a1.cached_tokens, a2.cached_tokens) == (first.cached_tokens, second.cached_tokens) == (0, len(
        first.prompt_ids) - 1)
    assert a1.token_ids == a2.token_ids == first.token_ids
    # another namespace, none, and the same prompt cut short inside a block (the prefix index lends partial
    # blocks within a namespace) all see what a first request sees
    for salt in ("beta", None, "alpha/x"):
        assert engine.explain(prompt, mode, cache_salt=salt).reused_tokens == 0
        g = engine.generate(prompt, mode=mode, max_new_tokens=4, cache_salt=salt)
        assert g.cached_tokens == 0 and g.token_ids == first.token_ids
        assert engine.generate(prompt, mode=mode, max_new_tokens=4, cache_salt=salt).cached_tokens == \
            second.cached_tokens
    # a prompt leaving alpha's inside a block: within alpha the prefix index lends that block's first tokens;
    # another namespace gets nothing
    cut = prompt[:-9] + " other?"
    assert engine.generate(cut, mode=mode, max_new_tokens=1, cache_salt="delta").cached_tokens == 0
    assert engine.generate(cut, mode=mode, max_new_tokens=1, cache_salt="alpha").cached_tokens >= \
        len(first.prompt_ids) - 12


def test_chunks_are_kept_per_namespace_and_public_ones_are_shared(loaded, docs):
    engine = fresh(loaded)
    engine.register([docs[1]], public=True)
    engine.register([docs[2]])
    system = "Answer from the documents.\n\n"

    def ask(doc, salt, system=system, chunks=()):
        text = system + doc + "\n\nQuestion: what is shown?\nAnswer:"
        return engine.generate(engine.split(text, chunk_texts=chunks, cache_salt=salt), max_new_tokens=2,
                               cache_salt=salt)

    def chunk_sources(g):
        return [(s.tokens, s.origin) for s in g.sources if s.kind == "chunk"]

    for doc in (docs[1], docs[2]):
        ask(doc, "alpha")
    public = ask(docs[1], "beta")
    (tokens, origin), = chunk_sources(public)
    # the public document is a hit; the system text before it and the question after it are not
    assert origin == "memory" and public.cached_tokens == tokens
    private = ask(docs[2], "gamma")
    assert chunk_sources(private) == [(chunk_sources(private)[0][0], "computed")] and private.cached_tokens == 0
    # a text marked for one request (the server's `chunks`) is private, unless it is a public document
    marked = ask(docs[3], "alpha", chunks=[docs[3]])
    assert chunk_sources(marked)[0][1] == "computed"
    assert chunk_sources(ask(docs[3], "beta", chunks=[docs[3]]))[0][1] == "computed"
    assert chunk_sources(ask(docs[1], "gamma", chunks=[docs[1]]))[0][1] == "memory"
    assert [s.public for s in engine.split(system + docs[1], chunk_texts=[docs[1]]) if isinstance(s, Chunk)] == [True]
    assert [s.public for s in engine.split(system + docs[3], chunk_texts=[docs[3]]) if isinstance(s, Chunk)] == [False]


def test_warm_and_prefetch_use_the_namespace(loaded, docs, tmp_path):
    docs = [d.strip() for d in docs]  # prefetch keys a text as a retriever returns it: stripped
    disk_store = TieredStore([MemoryStore(), DiskStore(tmp_path)])
    engine = fresh(loaded, disk_store)
    assert engine.warm([docs[0]], progress=False, cache_salt="alpha") == 1
    assert engine.warm([Chunk(docs[1], public=True)], progress=False, cache_salt="alpha") == 1
    assert engine.warm([docs[0]], progress=False, cache_salt="beta") == 1  # alpha's block is not beta's
    assert engine.warm([Chunk(docs[1], public=True)], progress=False, cache_salt="beta") == 0
    assert engine.warm([docs[1]], progress=False) == 0  # no namespace is where public chunks are keyed
    # a new engine on the same folder (memory empty): prefetch brings a namespace's own blocks only
    other = fresh(loaded, TieredStore([MemoryStore(), DiskStore(tmp_path)]))
    assert other.prefetch([docs[0]], cache_salt="gamma").result(30) == 0
    assert other.prefetch([docs[0]], cache_salt="alpha").result(30) == 1
    other.register([docs[1]], public=True)
    assert other.prefetch([docs[1]], cache_salt="gamma").result(30) == 1  # public: keyed in no namespace


def test_replies_cut_only_the_prompts_of_their_own_namespace(loaded):
    engine = fresh(loaded)
    prompt1 = system_text()[:400] + "\nAssistant:"
    g1 = engine.generate(prompt1, mode="exact", max_new_tokens=12, cache_salt="alpha")
    assert g1.text.strip()
    follow = prompt1 + g1.text + "\nUser: ok"
    pieces = [s.text for s in engine.split(follow, cache_salt="alpha")]  # the prompt's text may hold passages
    cut = pieces.index(g1.text)
    assert "".join(pieces[:cut]) == prompt1
    never = fresh(loaded)  # an engine that never generated the reply: how any other namespace must see it
    for salt in ("beta", None):
        assert engine.split(follow, cache_salt=salt) == never.split(follow)
        got = engine.generate(follow, mode="exact", max_new_tokens=1, cache_salt=salt)
        assert got.prompt_ids == never.generate(follow, mode="exact", max_new_tokens=1).prompt_ids
        assert got.cached_tokens == 0


def test_automatic_scaffolds_are_counted_and_used_per_namespace(loaded, docs):
    model, tok = loaded
    engine = pc_rag.Engine(model, tok, store="memory", auto_scaffold_after=2)
    prompt = [Text("Docs:\n"), Chunk(docs[0]), Text("\n\n"), Chunk(docs[1]), Text("\n\nQ?")]
    for _ in range(2):
        engine.generate(prompt, max_new_tokens=1, cache_salt="alpha")
    engine.generate(prompt, max_new_tokens=1, cache_salt="beta")  # once: below the threshold in beta
    engine.wait_for_background(timeout=60)
    assert "scaffold" in [s.kind for s in engine.generate(prompt, max_new_tokens=1, cache_salt="alpha").sources]
    for salt in ("beta", None, "gamma"):
        assert "scaffold" not in [r.kind for r in engine.explain(prompt, cache_salt=salt).rows]
    assert "scaffold" not in [s.kind for s in engine.generate(prompt, max_new_tokens=1, cache_salt="gamma").sources]
    assert engine.stats()["scaffolds"]["groups"] == 1


def test_a_redis_tier_keeps_namespaces_apart(loaded):
    fakeredis = pytest.importorskip("fakeredis")
    server = fakeredis.FakeServer()

    def engine():
        return fresh(loaded, TieredStore([MemoryStore(), RedisStore(client=fakeredis.FakeRedis(server=server))]))

    prompt = system_text() * 2 + "\nAssistant:"  # long enough for extents (groups of 256 tokens)
    engine().generate(prompt, mode="exact", max_new_tokens=1, cache_salt="alpha")
    assert engine().generate(prompt, mode="exact", max_new_tokens=1, cache_salt="beta").cached_tokens == 0
    assert engine().generate(prompt, mode="exact", max_new_tokens=1).cached_tokens == 0
    again = engine()
    assert any(p.members for p in again.explain(prompt, "exact", cache_salt="alpha").plan.pieces)  # an extent
    assert again.generate(prompt, mode="exact", max_new_tokens=1, cache_salt="alpha").cached_tokens >= 256


SECOND_PROCESS = """
import json, sys
import pc_rag
engine = pc_rag.Engine.from_pretrained(sys.argv[1], store=["memory", "disk:" + sys.argv[2]])
prompt = sys.argv[3]
out = {}
for salt in ("beta", "alpha"):
    g = engine.generate(prompt, mode="exact", max_new_tokens=1, cache_salt=salt)
    out[salt] = [g.cached_tokens, [s.origin for s in g.sources if s.source == "prefix"]]
print(json.dumps(out))
"""


def test_a_second_process_on_the_same_disk_folder_finds_only_its_namespace(loaded, tiny_path, tmp_path):
    model, tok = loaded
    prompt = system_text() * 2 + "\nAssistant:"
    first = pc_rag.Engine(model, tok, store=["memory", f"disk:{tmp_path}"])
    g = first.generate(prompt, mode="exact", max_new_tokens=1, cache_salt="alpha")
    files = [p.name for p in (tmp_path / "pc_rag-kv-v1").iterdir()]
    assert any(f.startswith("kv-extent-") for f in files) and any(f.startswith("kv-prefix-") for f in files)
    run = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(tiny_path), str(tmp_path), prompt],
                         capture_output=True, text=True, timeout=300, env=worktree_env(tmp_path / "other"))
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["beta"] == [0, []]
    cached, origins = out["alpha"]
    assert cached >= g.prompt_tokens - BLOCK_TOKENS and set(origins) == {"disk"}  # all but the short tail
