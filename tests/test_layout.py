"""The package's imports only go down: no circle between modules, no package reaching above its
layer (the README's architecture section draws the same picture), and the block manager stays
torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hispec_decode"
# bottom to top; a module imports from its own package and from lower layers only
LAYERS = [
    {"errors", "version"},
    {"validation", "knobs", "files", "data", "kernels", "extras", "hub"},  # field checks, policy knobs, atomic
    # writes, prompt sets; compiled ops; optional extras; can a Hub name be fetched
    {"inputs", "cache", "machine"},  # prompts as checked rows; block manager (torch-free) and paged K/V; the CPU
    {"sampling_params", "layers"},  # per-request settings; attention and linears
    {"config"},  # per-engine settings
    {"models", "decoding"},  # base models and the exit heads on them; sampling and policy math
    {"adapter", "engine"},  # the heads' format; sequences, decode loops, scheduler, runner
    {"tuning", "outputs"},
    {"api"},
    {"serving"},
    {"tools"},
    {"__init__"},
]


def _imports() -> dict[str, set[str]]:
    """Every module's imports of hispec_decode modules (top level, in functions and under TYPE_CHECKING)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("hispec_decode", *path.relative_to(PACKAGE).with_suffix("").parts)
        module = ".".join(parts[:-1]) if path.name == "__init__.py" else ".".join(parts)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                name = ".".join([*base, *([node.module] if node.module else [])])
                if node.level and not node.module:  # from . import x
                    deps.update(f"{name}.{a.name}" for a in node.names)
                elif name.startswith("hispec_decode"):
                    deps.add(name)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("hispec_decode"))
        graph[module] = deps
    known = set(graph)
    return {m: {d if d in known else d.rsplit(".", 1)[0] for d in ds} - {m} for m, ds in graph.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_module_imports_above_its_layer():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph = _imports()
    assert {_top(m) for m in graph} <= set(rank), f"a package without a layer: {sorted({_top(m) for m in graph} - set(rank))}"
    upward = [(m, d) for m, deps in graph.items() for d in deps
              if _top(d) != _top(m) and rank[_top(d)] >= rank[_top(m)]]
    assert not upward, f"imports that do not go down: {upward}"


def test_no_import_circle():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(dep):] + [dep])}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_block_manager_is_torch_free_and_nothing_imports_training():
    tree = ast.parse((PACKAGE / "cache" / "block_manager.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert "torch" not in names and "numpy" not in names
    for path in PACKAGE.rglob("*.py"):
        assert "hispec_train" not in path.read_text(), f"{path} mentions hispec_train (it imports us, never the reverse)"
