"""docs/architecture.md's rule, enforced: layers import only downward."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "msa"

# lower number = lower layer; a module may import its own layer or below
LAYERS = {
    "errors": 0,
    "scales": 1, "platform": 1, "launcher": 1,
    "layouts": 2, "semantics": 2, "problem": 2,
    "validation": 3,
    "planning": 4,
    "backends": 5,
    "hooks": 6,
    "builtin": 7,
    "registry": 8, "plugins": 8,
    "policy": 9,
    "workload": 10, "oracle": 10, "display": 10,
    "planner": 11, "api": 11,
    "distributed": 12, "integrations": 12, "bench": 12,
    "cli": 13, "__init__": 13, "__main__": 13,
}


def layer_of(module: str) -> int:
    parts = module.split(".")
    assert parts[0] == "msa", module
    # `from msa import name` of a non-module attribute counts as the package itself
    return LAYERS.get(parts[1], LAYERS["__init__"]) if len(parts) > 1 else LAYERS["__init__"]


def test_imports_only_point_downward() -> None:
    problems = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        module = ".".join(rel.parts)
        own = layer_of(module if module != "msa.__init__" else "msa")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                names = names[:1] if node.module != "msa" else names[1:]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[0] == "msa" and layer_of(name) > own:
                    problems.append(f"{module} (layer {own}) imports {name} (layer {layer_of(name)})")
    assert not problems, "\n".join(problems)
