"""No import cycle among the project's own modules (services/, trainer/): layers point one way.

The graph is built from the source text (every `import`, at module level, inside functions and
under `TYPE_CHECKING` alike: an import moved into a function to dodge a cycle is still a cycle),
so the check runs without importing torch, vLLM or megatron. `from pkg import sub` names the
submodule, not the package's `__init__` (Python loads a parent package before any child, which is
not a dependency of the child on its siblings).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "trainer")
GENERATED = ("services/common/pb/",)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every project file (generated stubs left out)."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            if any(str(rel).startswith(g) for g in GENERATED):
                continue
            parts = rel.with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules `module` imports anywhere in its source."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in known:  # `import a.b.c` of a non-module attribute
                    name = name.rpartition(".")[0]
                if name:
                    yield name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, path.name == "__init__.py")
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            yield from subs
            if base in known and len(subs) < len(node.names):
                yield base


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (itself excluded)."""
    known = project_modules(root)
    return {m: {d for d in imported(m, p, known) if d != m} for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    arrows = [f"  {a} -> {b}" for a in comp for b in sorted(graph[a] & set(comp))]
    return f"{len(comp)} modules:\n" + "\n".join(arrows)


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 100, "the walk found too few modules: is ROOT right?"
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(graph, c) for c in found)


def test_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (tmp_path / "services").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from trainer.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from trainer import a\n    return a\nB = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from trainer.d import D\n")
    (pkg / "d.py").write_text("from . import c\nD = 1\n")
    (pkg / "e.py").write_text("import trainer.a\n")
    graph = import_graph(tmp_path)
    assert graph["trainer.e"] == {"trainer.a"}
    assert cycles(graph) == [["trainer.a", "trainer.b"], ["trainer.c", "trainer.d"]]


# The backend-neutral core of the trainer: the GRPO step, its loss and corrections, the batch, the
# guard, the loop, the config and checkpoints. It talks to a backend through trainer.protocol
# only; the config's backend sections and the engines are loaded by name (trainer.registry), so
# even the modules that pick a backend (trainer.backend, trainer.ranks.worker) import none.
NEUTRAL_CORE = ("trainer.samples", "trainer.ranks.collectives", "trainer.losses",
                "trainer.grpo", "trainer.guard", "trainer.protocol", "trainer.replay",
                "trainer.weight_push", "trainer.loop", "trainer.config", "trainer.checkpoint",
                "trainer.checkpoint_snapshot", "trainer.registry", "trainer.backend", "trainer.ranks.worker")
BACKENDS = ("trainer.hf", "trainer.megatron")


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def arrows_into(graph: dict[str, set[str]], sources: tuple[str, ...],
                targets: tuple[str, ...]) -> list[str]:
    """Every import from a module under `sources` to one under `targets`, as 'a -> b'."""
    return [f"{a} -> {b}" for a in sorted(graph) if _under(a, sources)
            for b in sorted(graph[a]) if _under(b, targets)]


def test_neutral_core_imports_no_backend() -> None:
    graph = import_graph()
    assert all(any(_under(m, (c,)) for m in graph) for c in NEUTRAL_CORE), "a core module moved"
    found = arrows_into(graph, NEUTRAL_CORE, BACKENDS)
    assert not found, "the neutral trainer core imports a backend:\n  " + "\n  ".join(found)


def test_only_the_backends_import_a_backend() -> None:
    """Outside trainer.hf and trainer.megatron no trainer module imports either: the config
    sections and engines are loaded by name (trainer.registry.BACKENDS)."""
    graph = import_graph()
    found = [f"{a} -> {b}" for a in sorted(graph)
             if _under(a, ("trainer",)) and not _under(a, BACKENDS)
             for b in sorted(graph[a]) if _under(b, BACKENDS)]
    assert not found, "a trainer module imports a backend:\n  " + "\n  ".join(found)


def test_arrow_rule_sees_an_arrow_into_a_backend(tmp_path: Path) -> None:
    (tmp_path / "services").mkdir()
    for pkg in ("trainer", "trainer/hf"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "trainer/hf/packing.py").write_text("X = 1\n")
    (tmp_path / "trainer/grpo.py").write_text("def f():\n    from trainer.hf.packing import X\n")
    graph = import_graph(tmp_path)
    assert arrows_into(graph, ("trainer.grpo",), BACKENDS) == ["trainer.grpo -> trainer.hf.packing"]


def test_trainer_imports_no_service_above_it() -> None:
    """The trainer reaches the rollout service and the local launcher only through gRPC, Redis and
    the weight-sync group: what both need (the tiny model builder, tensor digests) sits below
    both, in services.common."""
    found = arrows_into(import_graph(), ("trainer",), ("services.rollout", "services.local"))
    assert not found, "the trainer imports a service:\n  " + "\n  ".join(found)


def test_common_imports_nothing_above_it() -> None:
    """services.common (the family registry among it) sits below the trainer and every service:
    a family module names backend code by a dotted path the backend resolves, never by import."""
    found = arrows_into(import_graph(), ("services.common",),
                        ("trainer", "services.rollout", "services.local", "services.store"))
    assert not found, "services.common imports a layer above it:\n  " + "\n  ".join(found)


# One room per model family: a family's name (its HF model_type) appears as a string only in its
# own modules, services/common/families/<name>.py and a backend's family_<name>.py; everything
# else asks the registry (services.common.families), so adding a family is one new file.
FAMILY_DIR = "services/common/families"


def family_names(root: Path = ROOT) -> set[str]:
    """The registered families, from the registry's module files (no import)."""
    return {p.stem for p in (root / FAMILY_DIR).glob("*.py") if not p.stem.startswith("_")}


def family_literals(root: Path = ROOT) -> list[str]:
    """Every string constant equal to a family name outside the family modules, as 'path:line'."""
    names = family_names(root)
    found = []
    for path in project_modules(root).values():
        rel = path.relative_to(root).as_posix()
        if rel.startswith(FAMILY_DIR + "/") or path.name.startswith("family_"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    return found


def test_family_names_only_in_family_modules() -> None:
    assert {"qwen3_moe", "gpt_oss", "deepseek_v3"} <= family_names(), "the registry moved"
    found = family_literals()
    assert not found, ("a family named outside its family module (read it from "
                       "services.common.families):\n  " + "\n  ".join(found))


def test_family_literal_rule_sees_a_name_outside_the_family_modules(tmp_path: Path) -> None:
    for pkg in ("services", "services/common", FAMILY_DIR, "trainer", "trainer/hf"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / FAMILY_DIR / "_base.py").write_text("X = 'base'\n")
    (tmp_path / FAMILY_DIR / "gpt_oss.py").write_text("NAME = 'gpt_oss'\n")
    (tmp_path / "trainer/hf/family_gpt_oss.py").write_text("NAME = 'gpt_oss'\n")
    (tmp_path / "trainer/hf/model.py").write_text("def f(t):\n    return t == 'gpt_oss'\n")
    assert family_names(tmp_path) == {"gpt_oss"}
    assert family_literals(tmp_path) == ["trainer/hf/model.py:2 'gpt_oss'"]
