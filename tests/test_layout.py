"""The house: no import circle, the tools apart from the core, functions a reader can hold in their
head, a training-steps file short enough to read in one sitting, and every Accelerate call where
docs/layout.md says it is."""

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "acc_trainer"
LONGEST = 80  # lines of one function, decorators and docstring included


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere (module level or inside a function)."""
    package = name if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists() else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `from . import x` names a module; `from .x import f` a name
                target = target.rpartition(".")[0]
            if target and target != name and target != "acc_trainer":
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    trees = modules()
    return {name: imports(name, tree, set(trees)) for name, tree in trees.items()}


def test_no_import_circle():
    edges = graph()
    assert "acc_trainer.training.loop" in edges and "acc_trainer.training.setup" in edges["acc_trainer.training.loop"]  # the graph is read
    circles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            circles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for target in sorted(edges.get(node, ())):
            visit(target, path + [node])
        done.add(node)

    for node in sorted(edges):
        visit(node, [])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_core_never_imports_the_tools():
    edges = graph()
    core = [name for name in edges if not name.startswith("acc_trainer.tools")]
    offenders = {name: sorted(t for t in edges[name] if t.startswith("acc_trainer.tools"))
                 for name in core if name != "acc_trainer.cli"}  # the command line dispatches to them
    assert not any(offenders.values()), offenders
    assert any(t.startswith("acc_trainer.tools") for t in edges["acc_trainer.cli"])


def test_every_function_fits_in_a_readers_head():
    long = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > LONGEST:
                    long.append(f"{name}.{node.name}: {node.end_lineno - start + 1} lines")
    assert not long, long


def test_the_training_steps_read_in_one_sitting():
    """loop.py holds the steps (epoch, micro-batch, optimizer step, gradient normalisation, logging, checkpoint,
    stop) and reads as a recipe: setup, one epoch, evaluation (evaluate_now), finish; setup, evaluation, the summary and the
    public API live beside it."""
    loop = (PACKAGE / "loop.py").read_text()
    assert len(loop.splitlines()) <= 500
    for module in ("setup", "evaluation", "summary", "api"):
        assert (PACKAGE / f"{module}.py").is_file(), module
    run = next(n for n in ast.parse(loop).body if isinstance(n, ast.FunctionDef) and n.name == "run")
    calls = sorted((n.lineno, n.col_offset, n.func.id) for n in ast.walk(run)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
    called = [name for _, _, name in calls]
    assert [c for c in called if c in ("setup", "train_epoch", "evaluate_now", "finish")] == \
        ["setup", "train_epoch", "evaluate_now", "finish"]


def test_no_bags_and_no_globals_that_steer():
    """No function returns a tuple of more than three things, and no module rebinds a global of its own (a
    flag set by one module for another, a cache that outlives a run)."""
    wide, rebound = [], []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) > 3:
                wide.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Global):
                rebound.append(f"{name}:{node.lineno} {node.names}")
    assert not wide, wide
    assert not rebound, rebound


def accelerate_calls() -> dict[str, set[str]]:
    """Where the core calls Accelerate: each method called on an Accelerator (`accelerator.x(...)`, or
    `r.accelerator.x(...)`) and the constructor, by module file."""
    found = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        if "tools" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id == "Accelerator":
                found["Accelerator(...)"].add(path.name)
            elif isinstance(f, ast.Attribute) and (isinstance(f.value, ast.Name) and f.value.id == "accelerator" or
                                                   isinstance(f.value, ast.Attribute) and f.value.attr == "accelerator"):
                found[f.attr].add(path.name)
    return found


def documented_calls() -> dict[str, set[str]]:
    """docs/layout.md's table of Accelerate calls: each call, and the modules it is made in."""
    text = (PACKAGE.parent / "docs" / "layout.md").read_text()
    table = text.split("## Where Accelerate is called")[1].split("\n## ")[0]
    found = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            for call in re.findall(r"`([^`]+)`", cells[0]):
                found[call] = set(re.findall(r"`(?:acc_trainer/)?([\w/]+\.py)`", cells[1]))
    return found


def test_every_accelerate_call_is_where_the_docs_say():
    """The table in docs/layout.md lists every Accelerate call of the core and the modules that make it: a
    call added, moved or removed without the docs fails here."""
    assert accelerate_calls() == documented_calls()
