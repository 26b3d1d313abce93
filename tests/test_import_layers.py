"""The import graph of pdserve's own modules: arrows point down the package order only, and no
module reaches itself through imports (lazy ones inside functions and those only for type
checking included), so every module can be read, and tested, below the ones that use it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# DESIGN.md: router, prefill_worker, decode_worker -> kvtransfer -> common -> kernels; the
# planner sits above the router, whose registry and traffic it reads over HTTP alone; the pdserve
# command sits above everything and nothing imports it, and the benchmarks above that.
# Inside kernels, a floor each: what every backend shares at the root (the interface, the KV
# formats, the portable torch backend, sizes and timing); the CPU and Triton backends; and what
# chooses among them (the registries, the device-neutral argmax).
LEVELS = {
    "benchmarks": 8,
    "pdserve": 7,
    "planner": 6,
    "router": 5,
    "prefill_worker": 5,
    "decode_worker": 5,
    "kvtransfer": 4,
    "common": 3,
    "kernels.registry": 2,
    "kernels.layer_kernels": 2,
    "kernels.argmax": 2,
    "kernels.cpu": 1,
    "kernels.triton": 1,
    "kernels": 0,
}
# Packages on one floor that must not reach each other: each backend stands on its own.
SIBLINGS = [("kernels.cpu", "kernels.triton")]
# The router and the planner never load torch: they reach no module that does.
TORCH_FREE = ["router", "planner"]
# Packages that speak to the router over its HTTP interface only, never importing it.
OVER_HTTP = {"planner": ("router", "prefill_worker", "decode_worker", "kvtransfer")}


def level(module: str) -> int:
    """The level of the longest package prefix of ``module`` in LEVELS."""
    parts = module.split(".")
    return next(
        LEVELS[prefix]
        for prefix in (".".join(parts[:n]) for n in range(len(parts), 0, -1))
        if prefix in LEVELS
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in LEVELS
        if "." not in package
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The pdserve modules ``path`` imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` names a module; `from module import name` does not.
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = own_modules()
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    # A package's __init__ is imported on the way to any of its modules; what it imports itself
    # is its own edge, not every submodule's.
    return {name: {dep for dep in deps if dep != name} for name, deps in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)) is not None:
            return cycle
    return None


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_point_down_the_package_order():
    upward = [
        f"{name} imports {dep}"
        for name, deps in import_graph().items()
        for dep in deps
        if level(dep) > level(name)
    ]
    assert not upward, "\n".join(upward)


def package_of(module: str, packages: tuple[str, ...]) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def test_backends_do_not_import_each_other():
    crossings = [
        f"{name} imports {dep}"
        for pair in SIBLINGS
        for name, deps in import_graph().items()
        for dep in deps
        if (own := package_of(name, pair)) is not None and package_of(dep, pair) not in (None, own)
    ]
    assert not crossings, "\n".join(crossings)


def test_the_router_reaches_no_kernel():
    graph = import_graph()
    for package in TORCH_FREE:
        reached = {name for name in graph if package_of(name, (package,))}
        frontier = list(reached)
        while frontier:
            for dep in graph[frontier.pop()]:
                if dep not in reached:
                    reached.add(dep)
                    frontier.append(dep)
        kernels = sorted(name for name in reached if package_of(name, ("kernels",)))
        assert not kernels, f"{package} reaches {kernels}"


def test_the_planner_reaches_the_services_over_http_only():
    reached = [
        f"{name} imports {dep}"
        for package, services in OVER_HTTP.items()
        for name, deps in import_graph().items()
        if package_of(name, (package,))
        for dep in deps
        if package_of(dep, services)
    ]
    assert not reached, "\n".join(reached)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
