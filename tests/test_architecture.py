"""The package's architecture, checked statically: module imports form no cycle, no module imports
another's private names, and modules import the package's modules at their top (a module that
needs a heavy one only on some paths reaches it through `rotsym_jax`'s lazy attributes, PEP 562,
documented in `rotsym_jax/__init__.py`). Every group kind a spec can bind is registered with every
piece, only its own module names it, and both paths time the same phases."""

import ast
import dataclasses
from pathlib import Path

import rotsym_jax as rj
from rotsym_jax import kinds

PACKAGE = Path(rj.__file__).parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imported(module: str, node: ast.ImportFrom | ast.Import) -> list[tuple[str, str | None]]:
    """(module imported, name imported from it or None) of one import statement, package modules only."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name.split(".")[0] == "rotsym_jax"]
    package = module.rsplit(".", 1)[0] if not module.endswith("__init__") else module
    parts = module.split(".")
    is_package = (PACKAGE.parent / Path(*parts) / "__init__.py").exists()
    base = parts if is_package else parts[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    del package
    if source.split(".")[0] != "rotsym_jax":
        return []
    out = []
    for alias in node.names:
        candidate = f"{source}.{alias.name}"
        if (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or (PACKAGE.parent / Path(*candidate.split("."))).is_dir():
            out.append((candidate, None))  # `from . import module`
        else:
            out.append((source, alias.name))
    return out


MODULES = _modules()


def test_no_import_inside_a_function_body():
    found = []
    for module, tree in MODULES.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and _imported(module, node):
                        found.append(f"{module}.{fn.name} line {node.lineno}")
    assert not found, f"package modules imported inside function bodies: {found}"


def test_no_private_name_is_imported_across_modules():
    found = [f"{module}: {source}.{name}" for module, tree in MODULES.items() for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom))
             for source, name in _imported(module, node) if name is not None and name.startswith("_") and name != "__version__"]
    assert not found, f"private names imported from other modules: {found}"


def test_module_imports_form_no_cycle():
    graph = {module: set() for module in MODULES}
    for module, tree in MODULES.items():
        for node in tree.body:  # module-level imports (the only ones, by the test above)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for source, _ in _imported(module, node):
                    if source in graph and source != module and source != "rotsym_jax":  # the package itself: lazy attributes
                        graph[module].add(source)
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {[' -> '.join(c) for c in cycles]}"


def test_the_checks_above_can_fail():
    """The import parser sees a cycle, a private import and a function-body import when they are there."""
    tree = ast.parse("from ..engine.alignment import _x\ndef f():\n    from . import stats\n")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _imported("rotsym_jax.merging.methods", imports[0]) == [("rotsym_jax.engine.alignment", "_x")]
    assert _imported("rotsym_jax.merging.methods", imports[1]) == [("rotsym_jax.merging.stats", None)]
    assert _imported("rotsym_jax.families.bert", ast.parse("from ..spec import Spec").body[0]) == [("rotsym_jax.spec", "Spec")]
    assert _layer_violations({"rotsym_jax.engine.groups": {"rotsym_jax.io.hf", "rotsym_jax.spec"}}) == ["rotsym_jax.engine.groups imports rotsym_jax.io.hf"]


def test_every_group_kind_has_every_piece():
    """Every kind a spec can bind is registered once (`kinds.KINDS`), under its record's name, with
    its record, an element that acts as every element does, a summary of what it moved, what its
    element mixes, its refusals and its learned parametrisation; every per-layer kind a solver of
    four functions, its activation sites, its cost matrices and OT fusion's view, which the
    residual stream's kind, solved around the others by the descent, has none of."""
    records, bindable = [*rj.spec._Shared.__subclasses__(), rj.spec.ResidualStream], set()
    while records:  # a kind's record may refine another's (a gated FFN's scaled units, a permutation group)
        record = records.pop()
        bindable.add(record.kind)
        records += record.__subclasses__()
    assert set(kinds.KINDS) == bindable
    for name, kind in kinds.KINDS.items():
        assert kind.name == name == kind.group.kind
        absent = [f.name for f in dataclasses.fields(kind) if getattr(kind, f.name) is None]
        per_layer = kind.group is not rj.spec.ResidualStream
        assert absent == ([] if per_layer else ["solver", "activations", "cost_matrices", "fusion"]), name
        acts = ("act_stacked",) if per_layer else ("act",)
        assert [m for m in ELEMENT_METHODS + acts if not callable(getattr(kind.element, m, None))] == [], name
        assert callable(kind.summary) and callable(kind.said) and callable(kind.mixed) and callable(kind.refusal), name
        assert all(callable(getattr(kind.learned, f.name)) for f in dataclasses.fields(kinds.Learned)), name
        if per_layer:
            assert all(callable(getattr(kind.solver, f)) for f in ("statistics", "reduce", "combine", "solve")), name
            assert callable(kind.cost_matrices), name
            assert all(callable(getattr(kind.activations, f.name)) for f in dataclasses.fields(kinds.ActivationSites)), name
            assert all(callable(getattr(kind.fusion, f.name)) for f in dataclasses.fields(kinds.Fusion)), name


# What every group element does (docs/engine.md, "Adding a group kind")
ELEMENT_METHODS = ("identity", "inverse", "then", "check", "replace", "dual", "squared")

# The modules that still switch on a kind's name (issue 71): the places a new kind must still be
# taught. The test below fails when one is added, and when one is converted (shrink this set).
STILL_NAMING_KINDS: set[str] = set()


def _kind_switches(tree: ast.Module) -> list[int]:
    """Lines comparing something's `.kind` with a kind's name, and dict literals keyed by two kinds'
    names or more, most of its keys (a table per kind, as the solvers, elements and summaries were)."""
    names = set(kinds.KINDS)

    def named(node) -> bool:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(x, ast.Constant) and x.value in names for x in items)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(x, ast.Attribute) and x.attr == "kind" for x in sides) and any(named(x) for x in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict):
            keyed = sum(isinstance(k, ast.Constant) and k.value in names for k in node.keys)
            if keyed >= 2 and 2 * keyed >= len(node.keys):  # not options that share two kinds' names (attention, residual)
                lines.append(node.lineno)
    return lines


def test_only_the_kinds_modules_name_a_kind():
    found = {module: lines for module, tree in MODULES.items()
             if module.split(".")[:2] != ["rotsym_jax", "kinds"] and (lines := _kind_switches(tree))}
    assert set(found) - STILL_NAMING_KINDS == set(), f"switches on a kind's name outside rotsym_jax/kinds/ (look it up: kinds.of(group)): {found}"
    assert STILL_NAMING_KINDS - set(found) == set(), "these no longer name a kind: take them out of STILL_NAMING_KINDS"


def test_the_kind_switch_finder_can_fail():
    tree = ast.parse('if g.kind == "experts":\n    pass\nt = {"attention": 1, "permutation": 2}\nu = g.kind in ("x", "permutation")\n'
                     'v = kind == "experts"\nw = {"permutation": 1, "none": 2}\nx = {"residual": 1, "attention": 2, "a": 3, "b": 4, "c": 5}\n')
    assert _kind_switches(tree) == [1, 3, 4]


# The folders in the order data flows (rotsym_jax/__init__.py): a module imports only from its own
# folder and from rows above its own; the foundations' modules import each other.
LAYERS = (
    ("pytree", "errors", "owned", "memory", "precision", "options", "checks", "timings", "version", "spec_rules", "spec", "transforms",
     "processes"),
    ("solvers", "families"),
    ("io", "engine"),
    ("kinds",),
    ("merging", "landscape"),
    ("verify",),
    ("streaming", "pipeline"),
    ("mergekit_plan",),
    ("mergekit_pipeline", "moe_pipeline"),
    ("cli",),
    ("__main__",),
)


def _unit(module: str) -> str:
    return module.split(".")[1]


def _layer(module: str) -> int:
    return next(i for i, row in enumerate(LAYERS) if _unit(module) in row)


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {source}" for module, sources in graph.items() for source in sources
                  if source != "rotsym_jax" and not (_unit(source) == _unit(module) or _layer(source) < _layer(module)
                                                     or _layer(source) == _layer(module) == 0))


def test_the_folders_import_only_from_the_rows_above():
    assert {_unit(m) for m in MODULES if m != "rotsym_jax"} == {u for row in LAYERS for u in row}, "a module or folder missing from LAYERS"
    graph = {module: {source for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)) for source, _ in _imported(module, node)}
             for module, tree in MODULES.items() if module != "rotsym_jax"}
    assert not _layer_violations(graph)


def test_every_error_is_a_rotsym_error():
    """One base for the library's refusals: a caller catches them all with `except rj.RotsymError`,
    and each is also the builtin it would expect (ValueError, TypeError, FileExistsError...)."""
    import importlib
    import inspect

    errors = []
    for module, tree in MODULES.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "").endswith(("Error", "Exception", "Busy")) for b in node.bases):
                errors.append(getattr(importlib.import_module(module), node.name))
    assert {e.__name__ for e in errors} >= {"SpecError", "CheckpointError", "StreamingError", "PipelineError", "InputError", "ProcessError"}
    assert [e.__name__ for e in errors if not issubclass(e, rj.RotsymError)] == []
    raises = [f"{m}:{n.lineno}" for m, tree in MODULES.items() for n in ast.walk(tree)
              if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and getattr(n.exc.func, "id", "") in ("ValueError", "TypeError", "FileNotFoundError", "FileExistsError")]
    assert raises == [], "raise InputError / InputTypeError / MissingPath / PathExists (rotsym_jax.errors), so that RotsymError catches it"
    assert inspect.getmro(rj.InputError)[1:3] == (rj.RotsymError, ValueError)
