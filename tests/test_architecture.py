"""The package's architecture, checked statically: module imports form no cycle, no module imports
another's private names, and modules import the package's modules at their top (a module that
needs a heavy one only on some paths reaches it through `rotsym_jax`'s lazy attributes, PEP 562,
documented in `rotsym_jax/__init__.py`). Every group kind a spec can bind has a solver and an
element, and both paths time the same phases."""

import ast
from pathlib import Path

import rotsym_jax as rj
from rotsym_jax import transforms
from rotsym_jax.engine import driver, report

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


def test_every_group_kind_has_a_solver_an_element_and_a_summary_of_what_moved():
    kinds = {rj.spec.AttentionBlock.kind, rj.spec.PermGroup.kind, rj.spec.ExpertGroup.kind}
    assert set(driver.SOLVERS) == set(transforms.ELEMENTS) == set(report._SUMMARIES) == kinds


# The folders in the order data flows (rotsym_jax/__init__.py): a module imports only from its own
# folder and from rows above its own; the foundations' modules import each other.
LAYERS = (
    ("pytree", "errors", "owned", "memory", "precision", "options", "checks", "timings", "version", "spec_rules", "spec", "transforms",
     "processes"),
    ("solvers", "families"),
    ("io", "engine"),
    ("merging", "landscape"),
    ("verify",),
    ("streaming", "pipeline"),
    ("mergekit_plan",),
    ("mergekit_pipeline", "moe_pipeline"),
    ("cli",),
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
