"""Tenants of one `pc-rag serve` (issue 24, item 1), on real server processes (free loopback ports): each tenant's
cache is its own, a request's `cache_salt` narrows it, public documents (`pc-rag warm --public`) are shared while
the prompts around them stay private, and `--shared-cache` gives back one cache for all.

References: the counts a first request of the same prompt gets (nothing reused); the same requests on a server
started with `--shared-cache` (the leak of issue 24, measured in the same test: a right guess of another
tenant's secret reused more tokens than a wrong one, and a prompt another tenant sent was faster to its first
token); the token counts of the public document (`pc-rag warm` tokenizes it on its own).

How the time to first token is compared without a flaky wall clock: what decides the time is the route of the
request (which tokens are computed and which read from the store), and that is checked exactly: a prompt another
tenant sent is computed token for token like one nobody sent. The wall-clock part compares medians over 24
interleaved trials each and only asks that the isolated server's gap be small next to the shared server's gap on
the same machine in the same test (so a slower or busier machine scales both).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("fastapi", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="pc-rag serve needs the serve extra (fastapi, uvicorn)")
httpx = pytest.importorskip("httpx")

from pc_rag.serve.process import ServerProcess  # noqa: E402
from pc_rag.testing import build_tiny_llama  # noqa: E402

from .conftest import worktree_env  # noqa: E402

# Tenants a test has to itself start with no history: their first request reuses nothing at all (a tenant's own
# earlier prompts lend it their first tokens: BOS, a common first word).
KEYS = "alpha-key-1 alpha\nalpha-key-2 alpha\n" + "".join(
    f"{t}-key {t}\n" for t in ("beta", "gamma", "delta", "zeta", "eta", "theta")) + "eps-key-1 eps\neps-key-2 eps\n"
WORDS = ("harbor", "velvet", "granite", "lantern", "orchid", "tundra", "cobalt", "meadow", "falcon", "quartz",
         "saffron", "glacier")
# A tail after every guess, as long as two prefix blocks: the block where two guesses part is full in both, so
# each is stored and looked up alike (a partial last block is never stored).
TAIL = "\n\nUser: say something about this text, at length, in plain words, for a reader new to it.\nAssistant:" * 2


def _system() -> str:
    from pydoc_data.topics import topics

    return topics["while"][:1200] + "\n\nThe passphrase is:"


def _public_doc() -> str:
    from pydoc_data.topics import topics

    return topics["import"][:2000]


PUBLIC: list[str] = []  # the chunks `pc-rag warm --public` cut _public_doc() into (the servers' fixture fills it)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(isolated, shared): two servers on one cache folder holding a public document warmed with
    `pc-rag warm --public`; the same keys; the second started with --shared-cache. The bench-size model (8 layers,
    hidden 512), not the tiny one: what a leak saves is a prefill, which must stand out of the HTTP round trip's and
    the server's own jitter (on the tiny model it was 3-8 ms against isolated lower quartiles apart by up to 6.5 ms,
    in full runs on this machine, at the commit that had last landed too)."""
    tiny_path = build_tiny_llama(tmp_path_factory.mktemp("bench"), size="bench", seed=0)
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "keys.txt").write_text(KEYS)
    (folder / "corpus").mkdir()
    (folder / "corpus" / "public.txt").write_text(_public_doc())
    env = worktree_env(folder / "cache")
    env.pop("PC_RAG_API_KEY", None)
    env.pop("PC_RAG_API_KEYS", None)
    warm = subprocess.run([sys.executable, "-m", "pc_rag", "warm", "--public", "--model", str(tiny_path),
                           str(folder / "corpus")], capture_output=True, text=True, env=env, timeout=300)
    assert warm.returncode == 0, warm.stderr[-2000:]
    from pc_rag.demo.retrieval import read_documents

    PUBLIC[:] = read_documents([folder / "corpus"])  # as warm cuts them
    assert f"{len(PUBLIC)} newly declared public" in warm.stdout, warm.stdout
    extra = ["--api-keys", folder / "keys.txt"]
    isolated = ServerProcess(tiny_path, extra=extra, env=env)
    shared = ServerProcess(tiny_path, extra=[*extra, "--shared-cache"], env=env)
    for s in (isolated, shared):
        s.launch()
    try:
        for s in (isolated, shared):
            s.wait_ready()
        yield isolated, shared
    finally:
        isolated.stop()
        shared.stop()


def _complete(server, key: str, prompt: str, **extra) -> dict:
    r = httpx.post(server.url + "/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _cached(server, key: str, prompt: str, **extra) -> int:
    return _complete(server, key, prompt, **extra)["prompt_tokens_details"]["cached_tokens"]


def _guesses(server, tag: str) -> list[tuple[int, int]]:
    """alpha sends a prompt with an 8-word secret; beta guesses it word by word, a right and a wrong guess per word
    (in alternating order): (cached tokens of the right guess, of the wrong one) per word."""
    rng = random.Random(tag)
    secret = rng.sample(WORDS, 8)
    system = f"[{tag}] " + _system()
    _cached(server, "alpha-key-1", system + " " + " ".join(secret) + TAIL)
    _cached(server, "beta-key", system + TAIL)  # beta's own history: the text it knows
    # ... sent once more after another word, so that the passages of the tail are reused (relocated) once and the
    # blank line between them stored: every guess then reuses beta's own passages alike (docs/design.md, Passages)
    _cached(server, "beta-key", system + " " + tag + TAIL)
    rounds = []
    for i, word in enumerate(secret):
        wrong = rng.choice([w for w in WORDS if w != word])
        known = system + "".join(" " + w for w in secret[:i])
        right_prompt, wrong_prompt = known + " " + word + TAIL, known + " " + wrong + TAIL
        if i % 2:
            wrong_n, right_n = _cached(server, "beta-key", wrong_prompt), _cached(server, "beta-key", right_prompt)
        else:
            right_n, wrong_n = _cached(server, "beta-key", right_prompt), _cached(server, "beta-key", wrong_prompt)
        rounds.append((right_n, wrong_n))
    return rounds


def test_a_right_guess_of_another_tenants_prompt_gets_no_more_cached_tokens(servers):
    """Issue 24's attack: beta finds alpha's secret word by word from `cached_tokens`. Isolated: a right guess gets
    exactly what a wrong one gets, in every round. The same requests on the --shared-cache server leak (the
    reference that this test can tell a leak: there the right guess reuses more, every round)."""
    isolated, shared = servers
    kept = _guesses(isolated, "isolated")
    leaked = _guesses(shared, "shared")
    print(json.dumps({"isolated": kept, "shared": leaked}))
    assert all(right == wrong for right, wrong in kept), kept
    assert all(right > wrong for right, wrong in leaked), leaked


def test_a_salt_narrows_within_a_tenant_and_never_widens(servers):
    """Tenant eps (two keys) and zeta, used by no other test: every namespace's first request reuses nothing."""
    isolated, _ = servers
    prompt = _system() + " narrow" + TAIL
    first = _complete(isolated, "eps-key-1", prompt, cache_salt="s1")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    everything = first["prompt_tokens"] - 1  # all but the last token, whose logits start the reply
    assert _cached(isolated, "eps-key-2", prompt, cache_salt="s1") == everything  # same tenant, same salt
    assert _cached(isolated, "eps-key-1", prompt) == 0  # the tenant without the salt
    assert _cached(isolated, "eps-key-1", prompt, cache_salt="s2") == 0
    assert _cached(isolated, "zeta-key", prompt, cache_salt="s1") == 0  # the same salt in another tenant


def test_within_a_tenant_reuse_is_unchanged(servers):
    """Two keys of one tenant share its cache as every request shares the --shared-cache server's: a repeated
    prompt and a follow-up reuse the same tokens on both (the first request's count may differ by the tokens each
    server's earlier prompts lend it: BOS, a first word)."""
    isolated, shared = servers
    prompt = f"Zebra {uuid.uuid4().hex}: " + _system() + " reuse" + TAIL
    # The next turn after a blank line: the prompt's last paragraph, a passage beta and alpha sent before (reused as
    # a chunk, docs/design.md "Passages"), stays whole, so the follow-up continues the prompt's own layout.
    follow = prompt + "\n\nUser: and then?\nAssistant:"
    counts = {}
    for name, server in (("isolated", isolated), ("shared", shared)):
        first = _complete(server, "alpha-key-1", prompt)
        counts[name] = [first["prompt_tokens"] - 1, _cached(server, "alpha-key-2", prompt),
                        _cached(server, "alpha-key-2", follow)]
        # new to the server but for what alpha's earlier prompts lend it (BOS, "Zebra", the passages of _system()
        # and the tail it sent in other tests)
        assert first["prompt_tokens_details"]["cached_tokens"] <= first["prompt_tokens"] - 20  # the new first line
    assert counts["isolated"] == counts["shared"], counts
    assert counts["isolated"][1] == counts["isolated"][0]  # all of the repeated prompt but its last token
    assert counts["isolated"][2] >= counts["isolated"][0]
    # --shared-cache: another tenant reuses alpha's prompt; isolated: only what beta's own prompts lend it (its first
    # tokens, BOS and "Zebra", and the passages of the same text and tail beta sent, reused wherever they land):
    # what it gets for the same text under another first line, which alpha never sent
    assert _cached(shared, "beta-key", prompt) == counts["shared"][0]

    def other() -> str:
        return f"Zebra {uuid.uuid4().hex}: " + _system() + " reuse" + TAIL

    for _ in range(2):  # beta's own history of this text (its passages seen, then stored, the blank lines too)
        _cached(isolated, "beta-key", other())
    own = _cached(isolated, "beta-key", other())
    assert abs(_cached(isolated, "beta-key", prompt) - own) <= 2  # a first hex digit or two may match either
    assert own <= counts["isolated"][0] - 32  # the first paragraph, new to beta, is computed


def test_public_documents_are_shared_and_the_prompts_around_them_are_not(servers):
    """The document warmed with `pc-rag warm --public` is read from the store by every tenant, the first time each
    sends it; a system text and question around it that alpha sent first are not reused by beta; a document a
    tenant marks (`chunks`) is not public."""
    isolated, _ = servers
    doc = PUBLIC[0]
    doc_tokens = _complete(isolated, "theta-key", doc, mode="full")["prompt_tokens"] - 1  # minus BOS
    prompt = f"Answer from the document.\n\n{doc}\n\nQuestion: what does it say?\nAnswer:"
    # the first request of each tenant (gamma, delta: no history): the document, and nothing else, is read
    assert _cached(isolated, "gamma-key", prompt) == doc_tokens
    assert _cached(isolated, "delta-key", prompt) == doc_tokens
    # a private document, marked by gamma: delta gets nothing of it, gamma reuses it at another position
    private = f"Note {uuid.uuid4().hex}: " + _system()[:600]
    assert _cached(isolated, "gamma-key", f"Read this.\n\n{private}\n\nQ?", chunks=[private]) <= 1  # BOS
    later = f"Then read this, please.\n\n{private}\n\nQ?"
    private_tokens = _cached(isolated, "gamma-key", later, chunks=[private])
    assert private_tokens > 100
    assert _cached(isolated, "delta-key", later, chunks=[private]) < private_tokens - 100


def test_a_prompt_another_tenant_sent_is_computed_and_timed_like_one_nobody_sent(servers):
    """24 trials each, interleaved: alpha sends a new prompt; beta sends it (matched) and a new one of the same
    length (unmatched). Isolated: the same tokens are computed for both, every trial; the time to the first token
    (lower quartile) differs by less than a third of what the --shared-cache server's does (measured here, where
    a matched prompt is read from the store). The times compared are the server's own (`usage.pc_rag.ttft_s`):
    the part of a client's wall time that the cache decides. On the tiny model the prefill that a leak saves is
    ~20 ms for 860 tokens, within the HTTP round trip's jitter on a fast machine (a wall-clock comparison failed
    on CI, shared gap 19 ms), and the server-side medians of isolated trials once differed by 8 ms of a 12 ms
    shared gap in a full run: the prompts are 1,700 tokens long. Since the prefill kernel took rows at any slots
    (stop 51) the prefill a leak saves is ~5-10 ms here, and the medians moved with the server's own background
    work (a document's encoding after a reply, which only adds time): isolated medians apart by 5.3 ms against a
    shared gap of 4.7 in a clean-clone CI run. So each side's lower quartile is compared: isolated 0.05-0.36 ms
    against shared 5.6-7.7 ms in three runs; later full runs failed at isolated 4.4 and -6.5 ms against shared 7.7
    and 6.8 (at the commit that had landed too). So the servers run the bench-size model (the fixture), where the
    prefill a leak saves is far above that jitter. The wall times are printed beside them."""
    isolated, shared = servers
    rng = random.Random(7)

    def words(n: int) -> str:
        return " ".join(f"{rng.getrandbits(32):08x}" for _ in range(n))

    def trials(server, n=24) -> dict[str, list]:
        out = {"matched": [], "unmatched": []}
        for i in range(n):
            matched, unmatched = words(200) + TAIL, words(200) + TAIL  # ~1,700 of the 2,048 positions
            _complete(server, "alpha-key-1", matched)
            order = (("matched", matched), ("unmatched", unmatched))
            for kind, prompt in order if i % 2 else order[::-1]:
                t0 = time.perf_counter()
                u = _complete(server, "beta-key", prompt)
                out[kind].append((u["pc_rag"]["ttft_s"], u["pc_rag"]["computed_tokens"], u["prompt_tokens"],
                                  time.perf_counter() - t0))
        return out

    trials(isolated, 4), trials(shared, 4)  # warm-up: the first requests of a process are slower
    kept, leaked = trials(isolated), trials(shared)

    def low(values) -> float:  # the lower quartile: background work on the server only ever adds time
        return statistics.quantiles(values, n=4)[0]

    def gap(t, at=0):  # at=0: the server's TTFT; 3: the client's wall time
        return low([x[at] for x in t["unmatched"]]) - low([x[at] for x in t["matched"]])

    def told_apart(t) -> float:
        """Share of requests a threshold halfway between the two medians classifies right (0.5: chance)."""
        cut = (statistics.median(x[0] for x in t["unmatched"]) + statistics.median(x[0] for x in t["matched"])) / 2
        right = sum(x[0] < cut for x in t["matched"]) + sum(x[0] >= cut for x in t["unmatched"])
        return right / (len(t["matched"]) + len(t["unmatched"]))

    print(json.dumps({"isolated_gap_s": gap(kept), "shared_gap_s": gap(leaked),
                      "isolated_wall_gap_s": gap(kept, 3), "shared_wall_gap_s": gap(leaked, 3),
                      "isolated_told_apart": told_apart(kept), "shared_told_apart": told_apart(leaked),
                      "isolated_median_s": {k: statistics.median(x[0] for x in v) for k, v in kept.items()},
                      "shared_median_s": {k: statistics.median(x[0] for x in v) for k, v in leaked.items()}}))
    # the route: matched or not, the same prompt tokens are reused, in every trial: those beta's own earlier prompts
    # lend it (BOS, a common first hex digit, the passages of the tail it sent before); every other one is computed
    for (_, c1, p1, _), (_, c2, p2, _) in zip(kept["matched"], kept["unmatched"], strict=True):
        assert abs((p1 - c1) - (p2 - c2)) <= 4 and max(p1 - c1, p2 - c2) <= len(TAIL) // 2, (kept, p1 - c1, p2 - c2)
    assert all(computed <= 2 for _, computed, _, _ in leaked["matched"])  # the leak: read from the store
    assert gap(leaked) > 0
    assert abs(gap(kept)) < gap(leaked) / 3, (gap(kept), gap(leaked))
