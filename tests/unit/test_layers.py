"""The code's shape, checked from its own source: layers that import one way, one owner of KV
bookkeeping, strategies that only propose (docs/ARCHITECTURE.md, "Layers")."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "trtspec"
LAB = PKG.parent / "lab"                 # measurement instruments: may import trtspec, never imported by it

# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS = [
    {"errors", "options", "__init__", "__main__"},
    {"export"},                    # checkpoints -> the Decoder, ONNX graphs, tokenizers
    {"runtime"},                   # the engine protocol, KV cache, batcher, step, strategies, scheduler
    {"engines"},                   # backends implementing runtime.engine.Engine
    {"assembly"},                  # config -> engine folders -> a Generator
    {"serve"},                     # the OpenAI-compatible server
    {"tools"},                     # bench, inspect, peers
    {"cli"},
]


def layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if part in names)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = ("trtspec",) + path.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(module: str, path: Path) -> set[str]:
    """Every trtspec module `module` imports, at the top or inside a function."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:          # annotations only: not imported when the code runs
            continue
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            target = ".".join(x for x in (base, node.module or "") if x)
            found |= {f"{target}.{a.name}" for a in node.names} | {target}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    known = modules()
    return {t for t in found if t in known and t != module}


def graph() -> dict[str, set[str]]:
    return {m: imports(m, p) for m, p in modules().items()}


def test_imports_go_down_the_layers():
    up = [f"{m} -> {t}" for m, ts in graph().items() for t in ts if layer(t) > layer(m)]
    assert not up, "imports into a higher layer:\n" + "\n".join(up)


def top_imports(path: Path) -> set[str]:
    """The top-level packages `path` imports (absolute imports; relative ones stay in its package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
    return found


def test_the_product_never_imports_the_lab():
    """lab/ (instruments, not shipped: test_wheel.py) sits above everything: it may import trtspec,
    and no module of trtspec imports it, at the top or inside a function."""
    bad = [str(p.relative_to(PKG.parent)) for p in sorted(PKG.rglob("*.py")) if "lab" in top_imports(p)]
    assert not bad, f"product modules importing the lab: {bad}"
    lab = sorted(LAB.rglob("*.py"))
    assert len(lab) > 20 and any("trtspec" in top_imports(p) for p in lab)      # the rule sees the lab


def patches(path: Path) -> list[str]:
    """Where `path` replaces something it imported from trtspec (a module's function, a class's
    method; not an upper-case constant): `name.attr = ...`, `del name.attr` or `setattr(name, ...)` with `name` bound by an import
    of trtspec (`import trtspec.x as name`, `from trtspec.x import name`, or relative, in trtspec)."""
    tree = ast.parse(path.read_text())
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("trtspec")):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("trtspec")}
    bound -= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}  # rebound
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id in bound \
                        and not x.attr.isupper():             # a CONSTANT is a setting, not a function
                    out.append(f"{path.name}:{node.lineno} {x.value.id}.{x.attr}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("setattr", "delattr") and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in bound:
            out.append(f"{path.name}:{node.lineno} {node.func.id}({node.args[0].id}, ...)")
    return out


def test_nothing_outside_the_tests_replaces_a_product_function():
    """The lab observes through the runtime's hooks (runtime/hooks.py): neither it nor the product
    replaces a function or a method of trtspec at run time (tests may, with monkeypatch)."""
    bad = [x for p in sorted([*PKG.rglob("*.py"), *LAB.rglob("*.py")]) for x in patches(p)]
    assert not bad, "replaced at run time:\n" + "\n".join(bad)
    assert _patches_of(PATCHING) == ["probe.py:2 step_mod.verify_and_commit", "probe.py:3 Scheduler.iteration",
                                     "probe.py:4 setattr(verify, ...)"]     # the rule sees a patch


PATCHING = """from trtspec.runtime import step as step_mod
step_mod.verify_and_commit = None
from trtspec.runtime.scheduler import Scheduler; Scheduler.iteration = None
from ..runtime import verify; setattr(verify, "choose_together", None)
"""


def _patches_of(source: str) -> list[str]:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "probe.py"
        f.write_text(source)
        return patches(f)


def test_no_package_cycle():
    def pkg(m: str) -> str:
        return ".".join(m.split(".")[:2])
    edges: dict[str, set[str]] = {}
    for m, ts in graph().items():
        edges.setdefault(pkg(m), set()).update(pkg(t) for t in ts if pkg(t) != pkg(m))
    for start in edges:                      # a package that reaches itself again
        seen, todo = set(), list(edges[start])
        while todo:
            p = todo.pop()
            assert p != start, f"package cycle through {start}"
            if p not in seen:
                seen.add(p)
                todo += edges.get(p, ())


def test_assembly_modules_do_not_import_each_other_both_ways():
    g = graph()
    both = [(a, b) for a in g for b in g[a] if a < b and a in g.get(b, ())]
    assert not both, f"modules importing each other: {both}"


def assigned_attributes(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(x, ast.Attribute):
                    out.append((x.attr, node.lineno))
    return out


def test_only_the_cache_and_the_batcher_move_kv_bookkeeping():
    allowed = {PKG / "runtime" / "kv_cache.py"}
    bad = [f"{p.relative_to(PKG)}:{line} assigns .{attr}" for p in modules().values() if p not in allowed
           for attr, line in assigned_attributes(p) if attr in ("length", "scratch")]
    assert not bad, "\n".join(bad)
    calls = {}
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("advance", "restore", "assume", "rewind"):
                calls.setdefault(m, []).append(node.func.attr)
    assert set(calls) <= {"trtspec.runtime.batch", "trtspec.runtime.costs",
                          "trtspec.tools.inspect_engines"}, calls   # engines never do
    assert calls["trtspec.runtime.batch"] and calls["trtspec.runtime.costs"] == ["assume"]
    assert set(calls["trtspec.tools.inspect_engines"]) == {"rewind"}       # the exactness sweep only


def test_strategies_only_propose():
    """No strategy file verifies or commits: the shared step (runtime/step.py) does, for all."""
    banned = {"commit", "verify", "verify_greedy", "verify_sampling", "verify_and_commit", "step"}
    for path in sorted((PKG / "runtime" / "strategies").glob("*.py")):
        tree = ast.parse(path.read_text())
        called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                  for n in ast.walk(tree) if isinstance(n, ast.Call)}
        named = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not (called | named) & banned, f"{path.name}: {sorted((called | named) & banned)}"
        assert "budget is not None" not in path.read_text() and "policy" not in path.read_text()


def test_strategies_reach_drafters_through_their_registry():
    """A strategy names its drafter (`make_drafter`, runtime/drafters/__init__.py) and reads its nodes'
    source from the drafter's tag: no strategy imports a drafter's module (each holds its drafter and
    the algorithm behind it: the max-gram matcher, the suffix tries), no strategy runs the draft's
    runner but through the draft model's part (draft_model.py, `self.model`), and every drafter file
    holds a registered drafter (a new one is its file and a registry line). A drafter declares what
    free and head drafters share, no more; the draft model is no drafter."""
    mods = modules()
    for m, path in mods.items():
        if m.startswith("trtspec.runtime.strategies."):
            bad = {i for i in imports(m, path) if i.startswith("trtspec.runtime.drafters.")}
            assert not bad, f"{path.name} imports {sorted(bad)}"
            text = path.read_text()
            assert "st.draft." not in text and "st.draft_catch_up" not in text, f"{path.name} runs the draft itself"
    registry = ast.parse((PKG / "runtime" / "drafters" / "__init__.py").read_text())
    table = next(n.value for n in ast.walk(registry) if isinstance(n, ast.AnnAssign) and n.target.id == "DRAFTERS")
    registered = {ast.literal_eval(k): v.id for k, v in zip(table.keys, table.values)}
    for path in sorted((PKG / "runtime" / "drafters").glob("*.py")):
        if path.stem in ("__init__", "base"):
            continue
        classes = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
        drafters = {name for name, c in classes.items() if any(getattr(b, "id", "") == "Drafter" for b in c.bases)}
        assert drafters & set(registered.values()), f"drafters/{path.name} holds no registered drafter"
        for name in drafters:
            own = next(ast.literal_eval(a.value) for a in classes[name].body if isinstance(a, ast.Assign)
                       and getattr(a.targets[0], "id", "") == "name")
            assert registered.get(own) == name, f"drafters/{path.name}: {name} is not DRAFTERS[{own!r}]"
    base = next(n for n in ast.parse((PKG / "runtime" / "drafters" / "base.py").read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == "Drafter")
    flags = {t.id for a in base.body if isinstance(a, (ast.Assign, ast.AnnAssign))
             for t in (a.targets if isinstance(a, ast.Assign) else [a.target])}
    assert flags == {"name", "scored", "reads_hidden", "reads_head"}, sorted(flags)
    assert "draft" not in registered and not any(m.endswith((".ngram", ".suffix")) for m in mods
                                                 if ".drafters." not in m and ".strategies." not in m)


# The budget's whole protocol (runtime/budget/__init__.py, `Budget`): a step begins, a proposer asks
# plan(Round) (what to take, whether to feed), the step observes the outcome, the scheduler reads the
# last step's expectation; `adaptive` tells a request whether to prefill its draft at once; `values`
# is the request's Values, which the budget owns (read as `state.values`); `ledger` the step's
# facts, which the proposer records (read as `state.ledger`).
BUDGET_PROTOCOL = {"begin", "plan", "observe", "expected_emitted", "adaptive", "values", "ledger"}


def budget_uses(path: Path) -> list[tuple[str, int]]:
    """Every attribute taken of a budget in `path` (`budget.x`, `st.budget.x`, and getattr(...budget, ...))."""
    def is_budget(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "budget") or \
            (isinstance(node, ast.Attribute) and node.attr == "budget")
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and is_budget(node.value):
            out.append((node.attr, node.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr") and \
                node.args and is_budget(node.args[0]):
            out.append((f"{node.func.id}(...)", node.lineno))
    return out


def test_nothing_outside_the_budget_reaches_past_its_protocol():
    """Proposers score candidates with the request's Values (budget/values.py) and ask the budget one
    thing, plan(Round); nothing outside runtime/budget/ reads its state or calls its internals."""
    inside = PKG / "runtime" / "budget"
    seen, bad = set(), []
    for path in modules().values():
        if inside in path.parents:
            continue
        for attr, line in budget_uses(path):
            seen.add(attr)
            if attr not in BUDGET_PROTOCOL:
                bad.append(f"{path.relative_to(PKG)}:{line} reads budget.{attr}")
    assert not bad, "\n".join(bad)
    assert {"begin", "plan", "observe"} <= seen            # the rule looks at the places that use it


LOOPS = (ast.For, ast.AsyncFor, ast.While)


def plan_calls(fn: ast.AST) -> list[tuple[int, list[ast.AST]]]:
    """Each `budget.plan(...)` call in a function (nested functions apart): its line and the loops
    around it, outermost first."""
    out = []

    def walk(node, loops):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "plan" \
                    and "budget" in ast.unparse(child.func.value):
                out.append((child.lineno, loops))
            walk(child, loops + [child] if isinstance(child, LOOPS) else loops)
    walk(fn, [])
    return out


def test_no_proposer_asks_the_budget_inside_its_loops():
    """The budget is asked once per round of drafting (plan(Round): what to take, whether to feed,
    the bars of nodes found later in the round): a proposer's `budget.plan` sits at most in its round
    loop, once per loop, and a function that asks it is never called from inside a loop. Drawn
    children and kept review tokens are weighed against the round's bars (Plan.joins), not asked
    about one by one."""
    bad, asked = [], 0
    for path in [*(PKG / "runtime" / "strategies").glob("*.py"), *(PKG / "runtime" / "drafters").glob("*.py"),
                 PKG / "runtime" / "draft_model.py"]:
        tree = ast.parse(path.read_text())
        fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        askers = set()
        for fn in fns:
            calls = plan_calls(fn)
            asked += len(calls)
            askers |= {fn.name} if calls else set()
            for line, loops in calls:
                if len(loops) > 1:
                    bad.append(f"{path.name}:{line} asks the budget in a loop inside a loop")
            per_loop = [id(loops[0]) for _, loops in calls if loops]
            if len(per_loop) != len(set(per_loop)):
                bad.append(f"{path.name}:{fn.name} asks the budget twice in one round")

        def called(fn, looped_only: bool) -> list[tuple[str, int]]:
            """The names of the functions `fn` calls (only those inside a loop with `looped_only`)."""
            out = []

            def walk(node, looped):
                for child in ast.iter_child_nodes(node):
                    f = getattr(child, "func", None)
                    own = isinstance(f, ast.Name) or \
                        (isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "self")
                    if isinstance(child, ast.Call) and own and (looped or not looped_only):   # this module's own
                        out.append((getattr(f, "attr", getattr(f, "id", "")), child.lineno))
                    walk(child, looped or isinstance(child, LOOPS))
            walk(fn, False)
            return out
        while True:                                        # a helper that calls one that asks, asks too
            more = {fn.name for fn in fns if any(name in askers for name, _ in called(fn, False))}
            if more <= askers:
                break
            askers |= more
        for fn in fns:
            bad += [f"{path.name}:{line} calls {name} (which asks the budget) in a loop"
                    for name, line in called(fn, True) if name in askers]
    assert not bad, "\n".join(bad)
    assert asked >= 8                                     # the rule sees the proposers that ask


LONGEST = 50          # lines from `def` to a function's last line, docstring included (gpt-fast's loop is ~50)


def test_no_runtime_function_is_longer_than_a_screen():
    """Every function in runtime/ fits on one screen, the step loop included (docs/ARCHITECTURE.md)."""
    long = [f"{p.relative_to(PKG)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
            for p in sorted((PKG / "runtime").rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > LONGEST]
    assert not long, "\n".join(long)
