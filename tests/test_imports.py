"""The package's import graph, read from the source (ast), lazy imports inside functions included.

References: no cycle among pc_rag's modules; the layers STYLE.md names: storage never imports the model code,
planning imports neither torch nor the model (any module of pc_rag/model/), only the model package talks to
transformers (but the tiny-checkpoint builder, the demo and the CLI's logging), and the core imports no
framework (the adapters live in integrations/, the server in pc_rag/serve)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pc_rag"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def runtime_nodes(tree: ast.AST):
    """Every node, but those under `if TYPE_CHECKING:` (imports for annotations only, never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(pc_rag modules imported by `name`, top-level names of other packages it imports)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inner, outer = set(), set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (inner if alias.name.startswith("pc_rag") else outer).add(alias.name.split(".")[0]
                                                                          if not alias.name.startswith("pc_rag")
                                                                          else alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module.startswith("pc_rag"):
                target = node.module
            else:
                outer.add(node.module.split(".")[0])
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            inner.update(subs if len(subs) == len(node.names) else [target, *subs])
    return {m for m in inner if m in known and m != name}, outer


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    known = modules()
    inner, outer = {}, {}
    for name, path in known.items():
        inner[name], outer[name] = imports(name, path, known)
    return inner, outer


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycles():
    edges, _ = graph()
    cycles = sorted(m for m in edges if m in reachable(edges, m))
    assert cycles == []


def test_the_graph_sees_imports():
    """The reader above is not blind: known edges of the request path are found."""
    edges, outer = graph()
    assert {"pc_rag.plan", "pc_rag.assemble", "pc_rag.store"} <= edges["pc_rag.engine"]
    assert "pc_rag.options" in edges["pc_rag.plan"] and "torch" in outer["pc_rag.assemble"]


def test_layers():
    edges, outer = graph()
    model_code = {m for m in edges if m.split(".")[:2] == ["pc_rag", "model"]} | {"pc_rag.assemble", "pc_rag.engine"}
    assert {"pc_rag.model", "pc_rag.model.runner", "pc_rag.model.families.gemma"} <= model_code
    for name in edges:
        if name.startswith("pc_rag.store"):
            assert not reachable(edges, name) & model_code, name
            assert "transformers" not in outer[name], name
    for name in ("pc_rag.plan", "pc_rag.prefix", "pc_rag.lookups", "pc_rag.text_index", "pc_rag.scaffolds"):
        deep = reachable(edges, name) | {name}
        assert not deep & model_code, name
    # The model package is what talks to transformers; besides it only the tiny-checkpoint builder, the demo's
    # embedder and the CLI's quieting of transformers' loading bars import it.
    talk = {name for name in edges if "transformers" in outer[name]}
    outside = {"pc_rag.testing", "pc_rag.demo.embeddings", "pc_rag.cli"}
    assert {"pc_rag.model.checkpoint"} <= talk <= model_code | outside
    frameworks = {"langchain", "langchain_core", "llama_index", "fastapi", "uvicorn", "starlette"}
    for name in edges:
        if not name.startswith(("pc_rag.serve", "pc_rag.demo")):
            assert not outer[name] & frameworks, name
