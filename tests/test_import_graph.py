"""The house's import graph: no module of the project imports itself back through others.

A circle makes a newcomer read files in a loop and breaks as soon as one module is imported first
from a new place, so every import statement counts here, including the ones inside functions
(a local import that only hides a circle from start-up is still a circle in the design).
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "gateway", "engines", "kernels", "policies", "router_models", "bench", "demo")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """The project's own modules: git-ignored folders (tokenyard/bench/peers/build holds llama.cpp's sources,
    .venv, build outputs) are someone else's code."""
    ignored = _git_ignored()
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (ROOT / "tokenyard" / pkg).rglob("*.py"):
            if not any(parent in ignored for parent in path.relative_to(ROOT).parents):
                mods[module_name(path)] = path
    return mods


def _git_ignored() -> set[Path]:
    """Ignored folders as paths relative to the root (empty when git is not there: a tarball)."""
    try:
        out = subprocess.run(["git", "status", "--ignored", "--porcelain", "--untracked-files=normal"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {Path(line[3:].rstrip("/")) for line in out.splitlines() if line.startswith("!! ") and line.endswith("/")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports, resolved to files (a package's __init__ counts as a module)."""
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` imports the submodule when one exists, else a name from pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_in_the_project() -> None:
    modules = project_modules()
    # a package's __init__ that only re-exports its children would tie every child to every user of
    # the package; it is an edge like any other, so such faces must not import back up either
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("pkg", ["tokenyard.policies", "tokenyard.router_models.runtime"])
def test_pure_packages_import_nothing_of_the_serving_stack(pkg: str) -> None:
    modules = project_modules()
    for name, path in modules.items():
        if name == pkg or name.startswith(pkg + "."):
            serving = ("gateway", "engines", "kernels", "cli", "bench", "demo")
            bad = {m for m in imports_of(name, path, modules) if m.split(".")[1] in serving}
            assert not bad, f"{name} imports {sorted(bad)}"
