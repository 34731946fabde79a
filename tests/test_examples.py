"""examples/: each RAG app runs end to end on the tiny model, and a second run reuses the documents' KV.

Reference: the app's own report line `prompt tokens: N (cached C, computed M)` (the engine's cached_tokens), in
a first and a second process on one cache folder: 0 cached in the first (an empty store), > 0 in the second.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import DEMO_CHUNKS, worktree_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script, framework", [("langchain_rag.py", "langchain_pc_rag"),
                                               ("llama_index_rag.py", "llama_index.llms.pc_rag")])
def test_example_second_run_reuses_kv(script, framework, tiny_path, seeded_embeddings, tmp_path):
    pytest.importorskip(framework)
    cache = tmp_path / "cache"
    shutil.copytree(seeded_embeddings, cache / "embeddings")
    cmd = [sys.executable, str(EXAMPLES / script), "--model", str(tiny_path), "--cache-dir", str(cache),
           "--max-chunks", str(DEMO_CHUNKS), "-k", "3", "--max-new-tokens", "4"]
    cached = []
    for _ in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True, env=worktree_env(cache), timeout=120)
        assert done.returncode == 0, done.stderr
        m = re.search(r"prompt tokens: (\d+) \(cached (\d+), computed (\d+)\)", done.stdout)
        assert m, done.stdout
        prompt, hit, computed = map(int, m.groups())
        assert hit + computed == prompt
        assert re.search(r"TTFT: [\d.]+ ms", done.stdout) and "store hit rate:" in done.stdout
        cached.append(hit)
    assert cached[0] == 0 and cached[1] > 0


def test_readme_test_line_installs_what_it_needs_and_ci_runs_it_verbatim():
    """A fresh machine after the README's first command has no pytest: the test line must install it.
    Reference: the README's "Run the tests" command, and the last line of `.ci/run`."""
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    section = readme[readme.index("\nRun the tests"):]
    line = next(t.strip() for t in section.splitlines() if t.startswith("    "))  # its indented code line
    assert line.startswith('pip install -e ".[test,demo,serve]" -e "integrations/langchain[test]" '
                           '-e "integrations/llama_index[test]" && python -m pytest -q tests')
    ci = [t for t in (root / ".ci" / "run").read_text().splitlines() if t.strip() and not t.startswith("#")]
    assert ci[-1] == line


def test_readme_is_a_newcomers_page_with_its_two_commands_first():
    """Issue 56: the README is the two commands, what the project does and links, at most 16 KB (the rest lives in
    docs/). Reference: the byte count, and the order of its indented code lines."""
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert len(readme.encode()) <= 16 * 1024, f"README.md is {len(readme.encode()):,} bytes"
    commands = [t.strip() for t in readme.splitlines() if t.startswith("    ") and t.strip()]
    assert commands[0].endswith("&& pc-rag demo") and commands[0].startswith("python3 -m venv .venv")
    assert commands[1].startswith('pip install -e ".[test,demo,serve]"')
    headings = [t for t in readme.splitlines() if t.startswith("## ")]
    assert headings[0] == "## On a fresh machine" and readme.index(commands[1]) < readme.index(headings[1])
