"""The house: sub-packages named for their concern whose imports run one way (the table in docs/layout.md), no
import circle, the tools and the command line apart from the core, no flag one module sets for another, functions
and modules a reader can hold in their head, a training-steps file short enough to read in one sitting, and every
Accelerate call where docs/layout.md says it is."""

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "acc_trainer"
LAYOUT = PACKAGE.parent / "docs" / "layout.md"
LONGEST = 80  # lines of one function, decorators and docstring included
LONGEST_IN_THE_RUN = 60  # in the training run's package and the command line
LONGEST_MODULE = 600
TOP_LEVEL_AT_MOST = 10
BASE = ("config", "flags", "patches", "stopping")  # the top-level modules every layer may import
COMMAND_LINE = ("cli", "__main__")


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


def part(module: str) -> str:
    """The part of the house a module belongs to: a sub-package's name, `base` or `command line`."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in BASE:
        return "base"
    if len(parts) == 2 and parts[1] in COMMAND_LINE:
        return "command line"
    return parts[1] if len(parts) > 1 else "acc_trainer"


def table_rows(heading: str) -> list[list[str]]:
    """The rows of the table under `heading` in docs/layout.md whose first cell is code (`...`), as lists of cells."""
    table = LAYOUT.read_text().split(f"## {heading}")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()]
    return [cells for cells in rows if len(cells) >= 2 and cells[0].startswith("`")]


def documented_layers() -> dict[str, set[str]]:
    """docs/layout.md's table of parts: each part, and the parts it may import."""
    return {cells[0].strip("`").removeprefix("acc_trainer/").strip("/"): set(re.findall(r"`([\w ]+)`", cells[2]))
            for cells in table_rows("The parts and what each may import")}


def test_no_import_circle():
    edges = graph()
    assert "acc_trainer.training.loop" in edges and "acc_trainer.training.setup" in edges["acc_trainer.training.loop"]
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


def test_the_parts_import_one_way_as_the_docs_say():
    """Every import between two parts of the house is one the table in docs/layout.md allows; the table itself runs
    one way (no part may import a part that may import it) and names every sub-package there is."""
    layers = documented_layers()
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages and packages <= set(layers), f"sub-packages missing from docs/layout.md: {packages - set(layers)}"
    assert {"base", "command line"} <= set(layers)
    for name, allowed in layers.items():
        back = [other for other in allowed if name in layers.get(other, ())]
        assert not back, f"{name} and {back} may import each other"
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            a, b = part(module), part(target)
            if a != b and a != "acc_trainer" and b not in layers[a]:
                wrong.append(f"{module} -> {target} ({a} may not import {b})")
    assert not wrong, wrong


def test_each_sub_package_says_what_it_holds_and_may_import():
    layers = documented_layers()
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        said = re.search(r"May import: (.*)\.", doc)
        assert len(doc) > 80 and said, f"{init}: a docstring saying what it holds, then 'May import: ...'"
        words = re.sub(r"\(.*?\)", "", said[1]).replace(" and ", ", ").split(",")
        named = {"base" if w.strip() == "the base" else w.strip() for w in words}
        assert named == layers[init.parent.name], (init, named, layers[init.parent.name])


def test_the_core_never_imports_the_tools_or_the_command_line():
    edges = graph()
    core = [name for name in edges if part(name) not in ("tools", "command line")]
    offenders = {name: sorted(t for t in edges[name] if part(t) in ("tools", "command line")) for name in core}
    assert not any(offenders.values()), offenders
    assert any(part(t) == "tools" for t in edges["acc_trainer.cli"])  # the command line dispatches to them
    above = ("training", "after_training", "trained", "tools", "command line", "acc_trainer")
    below = [name for name in edges if part(name) not in above]
    upward = {name: sorted(t for t in edges[name] if part(t) == "training") for name in below}
    assert not any(upward.values()), upward


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_AT_MOST, top


def test_every_function_and_module_fits_in_a_readers_head():
    long, longest = [], []
    for name, tree in modules().items():
        cap = LONGEST_IN_THE_RUN if part(name) in ("training", "command line") else LONGEST
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > cap:
                    long.append(f"{name}.{node.name}: {node.end_lineno - start + 1} lines (at most {cap})")
    for path in PACKAGE.rglob("*.py"):
        if len(path.read_text().splitlines()) > LONGEST_MODULE:
            longest.append(f"{path.relative_to(PACKAGE)}: {len(path.read_text().splitlines())} lines")
    assert not long, long
    assert not longest, longest


def test_the_training_steps_read_in_one_sitting():
    """loop.py holds the steps (epoch, micro-batch, optimizer step, gradient normalisation, logging, checkpoint,
    stop) and reads as a recipe: setup, one epoch, evaluation (evaluate_now), finish; setup, evaluation, the summary and the
    public API live beside it."""
    loop = (PACKAGE / "training" / "loop.py").read_text()
    assert len(loop.splitlines()) <= 500
    for module in ("setup", "evaluation", "summary", "api"):
        assert (PACKAGE / "training" / f"{module}.py").is_file(), module
    run = next(n for n in ast.parse(loop).body if isinstance(n, ast.FunctionDef) and n.name == "run")
    calls = sorted((n.lineno, n.col_offset, n.func.id) for n in ast.walk(run)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
    called = [name for _, _, name in calls]
    assert [c for c in called if c in ("setup", "train_epoch", "evaluate_now", "finish")] == \
        ["setup", "train_epoch", "evaluate_now", "finish"]


MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "OrderedDict", "deque", "Counter", "ContextVar", "local",
                 "WeakValueDictionary", "WeakKeyDictionary"}
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear", "remove",
            "discard", "set", "reset", "__setitem__"}


def module_state(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to something that can change in place (a list, dict or set, a
    ContextVar, a thread-local)."""
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        call = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else \
            value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
        if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or \
                call in MUTABLE_CALLS:
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def changed_in_place(tree: ast.Module, names: set[str]) -> list[str]:
    """Where a function changes one of `names` (the module's own, or another module's through its attribute):
    an item set or deleted, or a mutating method called."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                    if isinstance(t, ast.Subscript):
                        target = t.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                target = node.func.value
            name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) \
                else None
            if name in names:
                found.append(f"{fn.name}:{node.lineno} changes {name}")
    return found


def test_no_bags_and_no_state_that_steers():
    """No function returns a tuple of more than three things, and no module keeps state one module sets for another or
    that outlives a run: no `global` statement, no ContextVar, no module-level list, dict or set changed in place."""
    trees = modules()
    shared = {name for tree in trees.values() for name in module_state(tree)}
    wide, rebound, steering = [], [], []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) > 3:
                wide.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Global):
                rebound.append(f"{name}:{node.lineno} {node.names}")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    "contextvars" in (getattr(node, "module", None) or a.name) for a in node.names):
                steering.append(f"{name}:{node.lineno} imports contextvars")
        steering += [f"{name}.{where}" for where in changed_in_place(tree, shared)]
    assert not wide, wide
    assert not rebound, rebound
    assert not steering, steering


def test_the_state_rules_catch_what_they_name():
    """The rules above, on code that breaks them: a ContextVar one module sets, a module-level registry filled at run
    time, a list a run appends to."""
    tree = ast.parse("import contextvars\nSEEN = []\nFLAG = contextvars.ContextVar('f')\nREGISTRY = {}\n"
                     "def f():\n    SEEN.append(1)\n    FLAG.set(True)\n    REGISTRY['x'] = 1\n")
    assert module_state(tree) == {"SEEN", "FLAG", "REGISTRY"}
    assert len(changed_in_place(tree, module_state(tree))) == 3
    other = ast.parse("from . import runfiles\ndef g():\n    runfiles.FLAG.set(('model',))\n")
    assert changed_in_place(other, {"FLAG"}) == ["g:3 changes FLAG"]


# The collectives a module can call without an Accelerator: Accelerate's functions and torch.distributed's own.
COLLECTIVES = {"all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast", "broadcast_object_list",
               "gather", "gather_object", "pad_across_processes", "reduce", "reduce_scatter", "scatter"}


def accelerate_calls() -> dict[str, set[str]]:
    """Where the core calls Accelerate: each method called on an Accelerator (`accelerator.x(...)`, or
    `r.accelerator.x(...)`), the constructor, and every collective called without one (`accelerate.utils.x`, imported
    by name, and `torch.distributed.x` through `dist`, `dist_nn` or the full path), by module file (relative to the
    package)."""
    found = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        if "tools" in path.parts:
            continue
        where = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        from_utils = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and node.module == "accelerate.utils" for a in node.names}
        modules = {"dist": "torch.distributed", "dist_nn": "torch.distributed.nn"}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id == "Accelerator":
                found["Accelerator(...)"].add(where)
            elif isinstance(f, ast.Name) and f.id in from_utils and f.id in COLLECTIVES:
                found[f"accelerate.utils.{f.id}"].add(where)
            elif isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and ast.unparse(f.value) in (
                    *modules, *modules.values()):
                found[f"{modules.get(ast.unparse(f.value), ast.unparse(f.value))}.{f.attr}"].add(where)
            elif isinstance(f, ast.Attribute) and (isinstance(f.value, ast.Name) and f.value.id == "accelerator" or
                                                   isinstance(f.value, ast.Attribute) and f.value.attr == "accelerator"):
                found[f.attr].add(where)
    return found


def documented_calls() -> dict[str, set[str]]:
    """docs/layout.md's table of Accelerate calls: each call, and the modules it is made in."""
    found = {}
    for cells in table_rows("Where Accelerate is called"):
        for call in re.findall(r"`([^`]+)`", cells[0]):
            found[call] = set(re.findall(r"`(?:acc_trainer/)?([\w/]+\.py)`", cells[1]))
    return found


def test_every_accelerate_call_is_where_the_docs_say():
    """The table in docs/layout.md lists every Accelerate call of the core and the modules that make it: a
    call added, moved or removed without the docs fails here."""
    assert accelerate_calls() == documented_calls()


def test_only_main_decides_hands_the_main_process_answer_to_the_others():
    """Where the main process computes and the others wait, one helper hands an outcome over whatever happened
    (processes.main_decides, each_tries): no other module broadcasts, and no raw torch.distributed collective is
    made outside the two documented places."""
    calls = accelerate_calls()
    assert calls["accelerate.utils.broadcast_object_list"] == {"distributed/processes.py"}
    raw = {call: modules for call, modules in calls.items() if call.startswith("torch.distributed")}
    assert raw == {"torch.distributed.barrier": {"cli.py"}, "torch.distributed.nn.all_reduce": {"workload/models.py"}}


def test_the_old_name_of_after_training_still_imports():
    """`trained/` became `after_training/` (a name read apart from `training/`); imports written for the old name get
    the same module objects."""
    import acc_trainer
    from acc_trainer.after_training import consolidating, inference
    from acc_trainer.trained import consolidating as old_consolidating
    from acc_trainer.trained.inference import evaluate

    assert evaluate is inference.evaluate is acc_trainer.evaluate and old_consolidating is consolidating


# What asks which engine runs: Accelerate's distributed types of an engine, `is_fsdp2`, an engine compared by name, a
# class name tested for FSDP2's renaming, a model asked whether FSDP2 or ZeRO-3 holds it. Only the engines' rooms
# (and patches.py, the upstream workarounds) may.
ENGINE_CHECK = re.compile(r"is_fsdp2|DistributedType\.(FSDP|DEEPSPEED|MEGATRON_LM)\b|engine\w*(\.name)?\s*[!=]=|"
                          r"[!=]=\s*\"(DDP|FSDP|DEEPSPEED)\"|\"(DDP|FSDP|DEEPSPEED)\"\s*[!=]=|in \(\"(DDP|FSDP|DEEPSPEED)\"|"
                          r"startswith\(\"FSDP\"\)|\bFSDPModule\b|\bds_id\b")


def engine_checks(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if ENGINE_CHECK.search(line) and not line.strip().startswith("#")]


def test_only_the_engines_rooms_ask_which_engine_runs():
    """What differs per engine (plain/DDP, FSDP2, DeepSpeed) is in its room, distributed/engines/; the rest of the run
    asks the engine object. An `is_fsdp2`, a distributed type or an engine's name compared anywhere else fails here."""
    rooms = PACKAGE / "distributed" / "engines"
    found = {str(path.relative_to(PACKAGE)): engine_checks(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))
             if rooms not in path.parents and path.name != "patches.py"}
    assert {path: lines for path, lines in found.items() if lines} == {}
    # The rule catches what it names (as the code was before the rooms).
    assert len(engine_checks('    if group.engine != "DDP":\n        x = accelerator.is_fsdp2\n'
                         '    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):\n'
                         '    name = next(c for c in mro if not c.__name__.startswith("FSDP"))\n'
                         '    if saved_engine == "DDP":\n')) == 5 and len(engine_checks(
                             'if engine == "FSDP":\nif r.engine != "DDP":\nif "DEEPSPEED" == e:\n')) == 3


def modules_named(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules `name` names in its imports: `from ..outputs import run_folder` names outputs/run_folder,
    not the sub-package around it; `from .state import Clock` names training/state."""
    package = name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("acc_trainer"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
    return out - {"acc_trainer"}


def test_setup_reads_as_a_recipe():
    """training/setup.py's `setup` is the stages in one order, written once (docs/layout.md, "Setup, a recipe"): at most
    40 lines, each stage a function of the part it concerns, so setup.py names at most 15 of the package's modules.
    The stages come in the documented order."""
    trees = modules()
    tree = trees["acc_trainer.training.setup"]
    named = modules_named("acc_trainer.training.setup", tree, set(trees))
    assert len(named) <= 15, sorted(named)
    (recipe,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "setup"]
    assert recipe.end_lineno - recipe.lineno + 1 <= 40
    source = ast.get_source_segment((PACKAGE / "training" / "setup.py").read_text(), recipe)
    stages = ["_per_step(", "run_folder.origin(", "scoring.first_samples(", "_accelerator(", "adapters.starting_weights(",
              "adapters.as_it_trains(", "_reference(", "scoring.sized(", "_prepared(", "run_state.started(",
              "run_folder.opened("]
    assert [source.count(stage) for stage in stages] == [1] * len(stages)  # each once
    assert [source.index(stage) for stage in stages] == sorted(source.index(stage) for stage in stages)
    documented = re.findall(r"^\d+\. \*\*(.+?)\*\*", (PACKAGE.parent / "docs" / "layout.md").read_text(), re.M)
    assert len(documented) >= 8 and documented[0].startswith("The objective")
