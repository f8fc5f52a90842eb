"""Parameter paths: nested params <-> flat {"a/b/0/c": leaf} dicts.

Every params pytree in rotsym_jax is a nested dict (Flax NNX's pure-dict state: layer lists are
dicts with int keys). A leaf is addressed by its `/`-joined path, e.g.
`layers/3/attention/query/kernel`; specs, name maps and error messages all use these paths.
"""

from __future__ import annotations

from typing import Any, Mapping

Params = dict[str, Any]


def flatten(params: Mapping) -> dict[str, Any]:
    """Nested dict -> {path: leaf}, paths `/`-joined, in sorted-key order per level."""
    flat: dict[str, Any] = {}

    def visit(node, prefix):
        if isinstance(node, Mapping):
            for key in sorted(node, key=_sort_key):
                visit(node[key], f"{prefix}/{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    visit(params, "")
    return flat


def unflatten(flat: Mapping[str, Any]) -> Params:
    """{path: leaf} -> nested dict; all-digit path parts become int keys (NNX list indices)."""
    nested: Params = {}
    for path, leaf in flat.items():
        parts = [int(p) if p.isdigit() else p for p in path.split("/")]
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {path!r} goes through a leaf at {part!r}")
        if parts[-1] in node:
            raise ValueError(f"duplicate path {path!r}")
        node[parts[-1]] = leaf
    return nested


def _sort_key(key):
    # Layer 10 after layer 9: ints sort numerically, before strings.
    return (0, key, "") if isinstance(key, int) else (1, 0, str(key))
