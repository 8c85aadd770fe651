"""The import contract of weightsync's layers, as a checker over a source tree.

Every module's imports (top-level and inside functions) are read with `ast`, never executed,
and checked against the rules below; `check_tree` returns one sentence per violation.

Rules:

- each package may import only the packages below it (`ALLOWED`, the layers of the design);
- `layout`, `plan` and `predict` are pure: no torch (so no torch.distributed), no networking;
- `predict` sits on `plan` and only the command line imports it;
- `transport` knows bytes, not names: nothing of weightsync but errors and itself;
- `receiver` imports no web framework;
- nothing in the library imports `testing`, except the command line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

# The packages and top-level modules of weightsync, and what each may import of the others.
_BASE = {
    "errors",
    "layout",
    "torch_dtypes",
    "checkpoint",
    "cuda_events",
    "delta_codec",
    "delta_wire",
    "delta_kernels",
    "delta_triton",
}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "layout": {"errors"},
    "torch_dtypes": {"layout"},
    "checkpoint": {"errors", "layout"},
    "cuda_events": set(),
    "delta_triton": set(),
    "delta_kernels": {"delta_triton"},
    "delta_codec": {"delta_kernels"},
    "delta_wire": set(),
    "plan": {"errors", "layout"},
    "predict": {"errors", "layout", "plan"},
    "transport": {"errors"},
    "control": _BASE,
    "receiver": _BASE | {"transport", "control"},
    "engine": _BASE | {"receiver"},
    "server": _BASE | {"transport", "control", "receiver", "engine"},
    "export": _BASE | {"plan"},
    "sender": _BASE | {"plan", "transport", "export"},
    "manager": _BASE | {"plan", "transport", "control", "export", "sender"},
    "baseline": _BASE
    | {"plan", "transport", "control", "receiver", "engine", "server", "export", "sender"}
    | {"manager"},
    "integrations": _BASE
    | {"plan", "transport", "control", "receiver", "engine", "server", "export", "sender"}
    | {"manager", "baseline"},
    "testing": _BASE
    | {"plan", "transport", "control", "receiver", "engine", "server", "export", "sender"}
    | {"manager", "baseline", "integrations"},
    "cli": _BASE
    | {"plan", "transport", "control", "receiver", "engine", "server", "export", "sender"}
    | {"manager", "baseline", "integrations", "testing", "predict"},
}
# Top-level modules every layer may import: the package root (its names load lazily).
_ROOT_MODULES = {"__init__", "__main__"}

PURE = ("layout", "plan", "predict")
_NETWORK = ("socket", "http", "urllib", "aiohttp", "httpx", "requests", "fastapi", "uvicorn")
_FORBIDDEN_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "layout": ("torch", *_NETWORK, "mooncake"),
    "plan": ("torch", *_NETWORK, "mooncake"),
    "predict": ("torch", *_NETWORK, "mooncake"),
    "receiver": ("fastapi", "starlette", "uvicorn"),
}


def _imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, dotted module)`` of every import in a module, relative ones resolved later."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _layer(package_root: Path, path: Path) -> str:
    parts = path.relative_to(package_root).with_suffix("").parts
    return parts[0]


def check_tree(package_root: Path) -> list[str]:
    """Every violation of the contract in the package at `package_root` (``.../weightsync``).

    Returns:
        One sentence per violation: the module, the line, what it imports and the rule.
    """
    problems: list[str] = []
    for path in sorted(package_root.rglob("*.py")):
        layer = _layer(package_root, path)
        where = path.relative_to(package_root.parent)
        if layer in _ROOT_MODULES:
            continue
        allowed = ALLOWED.get(layer)
        if allowed is None:
            problems.append(f"{where}: package {layer!r} has no place in the import contract")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imports(tree):
            top, _, rest = module.partition(".")
            if top == "weightsync":
                target = rest.partition(".")[0] or "__init__"
                if target in _ROOT_MODULES or target == layer:
                    continue
                if target not in allowed:
                    problems.append(
                        f"{where}:{line}: {layer} imports weightsync.{target} ({module}); "
                        f"{layer} may import only {sorted(allowed) or 'nothing of weightsync'}"
                    )
                continue
            for forbidden in _FORBIDDEN_THIRD_PARTY.get(layer, ()):
                if module == forbidden or module.startswith(forbidden + "."):
                    problems.append(
                        f"{where}:{line}: {layer} imports {module}, which {layer} must not "
                        f"({'pure: no torch, no network' if layer in PURE else 'no web framework'})"
                    )
    return problems
