"""backend/ is layered: each folder imports only the folders below it (LAYERS, bottom first), and
no modules import each other in a circle at import time. Read from the source, nothing imported.

The shared types (backend/*.py: config, requests, sampling parameters, ...) are the bottom layer;
`backend.generate`, the offline command, is the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parents[2] / "backend"
LAYERS = (
    "types",  # backend/*.py
    "kernels",
    "attention",
    "quantization",
    "distributed",
    "lora",
    "layers",
    "models",
    "loading",
    "scheduling",
    "sampling",
    "speculative",
    "runner",
    "engine",
    "process",
    "tools",
    "generate",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(BACKEND.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def layer(module: str) -> str:
    """The layer of `backend.x...`: its folder, else 'types' (or 'generate')."""
    first = module.split(".")[1] if "." in module else ""
    if (BACKEND / first).is_dir():
        return first
    return "generate" if first == "generate" else "types"


def imports(path: Path, module_scope_only: bool = False) -> set[str]:
    """The backend modules `path` imports (at module scope only, when asked: what runs at
    import time)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_scope_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("backend"):
            for alias in node.names:  # `from backend.x import y`: y may be a module
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("backend."))
    return {m for m in found if _is_module(m)}


def _is_module(name: str) -> bool:
    path = BACKEND.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted(p for p in BACKEND.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_folder_is_a_layer():
    folders = {p.name for p in BACKEND.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(LAYERS) - {"types", "generate"}


def test_each_layer_imports_only_the_layers_below_it():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in sources():
        source = module_name(path)
        for target in imports(path):
            if rank[layer(target)] > rank[layer(source)]:
                upward.append(f"{source} ({layer(source)}) imports {target} ({layer(target)})")
    assert not upward, "imports of a layer above:\n" + "\n".join(upward)


def test_no_import_cycle_at_import_time():
    graph = {module_name(p): imports(p, module_scope_only=True) for p in sources()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in graph.get(module, ()):
            visit(target, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_a_layer_above_is_caught():
    """The check itself: an engine module imported by the scheduler would be reported."""
    assert layer("backend.engine.executor") == "engine"
    assert layer("backend.config") == "types" and layer("backend.generate") == "generate"
    assert LAYERS.index("engine") > LAYERS.index("scheduling")
