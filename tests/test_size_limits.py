"""Size limits of the library's code (issue 71): no module over 800 lines, no function over 100
lines or with more than 10 parameters (positional, keyword-only, *args and **kwargs counted;
self and cls not). Read with `ast`, nothing imported, so every module is checked, the optional
families' too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rotsym_jax"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100
MAX_PARAMETERS = 10


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a caller can give: positional-only, positional, keyword-only, *args, **kwargs; not self or cls."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return sum(name not in ("self", "cls") for name in names)


def functions(tree: ast.AST, outer: str = ""):
    """Every function and method in `tree`, nested ones too, with its qualified name (`Class.method`)."""
    for node in ast.iter_child_nodes(tree):
        name = f"{outer}{getattr(node, 'name', '')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield name, node
        yield from functions(node, f"{name}." if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else outer)


def oversized(source: str, where: str) -> list[str]:
    """One line per limit `source` (the text of module `where`) breaks, naming the module or the
    function (its line) and its size against the limit."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{where}: {lines} lines (module limit {MAX_MODULE_LINES})")
    for name, node in functions(ast.parse(source, where)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            found.append(f"{where}:{node.lineno} {name}: {length} lines (function limit {MAX_FUNCTION_LINES})")
        count = parameter_count(node)
        if count > MAX_PARAMETERS:
            found.append(f"{where}:{node.lineno} {name}: {count} parameters (limit {MAX_PARAMETERS})")
    return found


def modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 50, f"{PACKAGE}: found {len(found)} modules; expected the whole package"
    return found


def test_no_module_or_function_over_the_limits():
    found = [line for path in modules() for line in oversized(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "over the size limits (split the module or function, or group options as options.py does):\n" + "\n".join(found)


def _function(parameters: str, body_lines: int = 1) -> str:
    return f"def f({parameters}):\n" + "    pass\n" * body_lines


@pytest.mark.parametrize("parameters, count", [
    ("", 0),
    ("self, a, b", 2),
    ("cls, /, a, *args, b=1, **kwargs", 4),
    ("a, b, c, d, e, f, g, h, i, j", 10),
    ("a, b, c, d, e, f, g, h, i, *, j, **k", 11),
    ("a, /, b, *rest, c, d, e, f, g, h, i, j", 11),
])
def test_parameters_are_counted_as_a_caller_gives_them(parameters, count):
    (node,) = ast.parse(_function(parameters)).body
    assert parameter_count(node) == count


def test_each_limit_is_named_where_it_is_broken():
    """The checker itself: each limit exactly at its bound passes, one past it is named."""
    assert oversized(_function("a, b, c, d, e, f, g, h, i, j", MAX_FUNCTION_LINES - 1), "m.py") == []
    assert oversized(_function("a, b, c, d, e, f, g, h, i, j, k"), "m.py") == ["m.py:1 f: 11 parameters (limit 10)"]
    assert oversized(_function("", MAX_FUNCTION_LINES), "m.py") == ["m.py:1 f: 101 lines (function limit 100)"]
    method = "class C:\n    def g(self, a, b, c, d, e, f, g, h, i, *args, **kwargs):\n        pass\n"
    assert oversized(method, "m.py") == ["m.py:2 C.g: 11 parameters (limit 10)"]
    assert oversized("x = 1\n" * MAX_MODULE_LINES, "m.py") == []
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1), "m.py") == ["m.py: 801 lines (module limit 800)"]
    nested = "def outer():\n    " + _function("a, b, c, d, e, f, g, h, i, j, k").replace("\n", "\n    ")
    assert oversized(nested, "m.py") == ["m.py:2 outer.f: 11 parameters (limit 10)"]
