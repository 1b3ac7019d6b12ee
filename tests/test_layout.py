"""The house: no import circle, the tools apart from the core, functions a reader can hold in their
head, and every distributed call in the loop's file (docs/layout.md)."""

import ast
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
    assert "acc_trainer.loop" in edges and "acc_trainer.state" in edges["acc_trainer.loop"]  # the graph is read
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


def test_every_distributed_call_is_in_the_loops_file():
    loop = (PACKAGE / "loop.py").read_text()
    for call in ("accelerator.prepare(", "accelerator.accumulate(", "accelerator.backward(",
                 "accelerator.gather_for_metrics(", "accelerator.reduce(", "accelerator.save_state(",
                 "accelerator.load_state(", "accelerator.save_model("):
        assert call in loop, call
    # ...and the loop reads as a recipe: setup, one epoch, evaluation, finish.
    run = next(n for n in ast.parse(loop).body if isinstance(n, ast.FunctionDef) and n.name == "run")
    calls = sorted((n.lineno, n.col_offset, n.func.id) for n in ast.walk(run)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
    called = [name for _, _, name in calls]
    assert [c for c in called if c in ("setup", "train_epoch", "evaluate", "finish")] == \
        ["setup", "train_epoch", "evaluate", "finish"]
