"""The package map of docs/architecture.md, enforced: each part imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pulsesync

PACKAGE = Path(pulsesync.__file__).parent

# Top-level part of pulsesync -> layer. A part imports only itself and strictly lower layers.
LAYERS = {
    # foundation: errors, then leaf utilities, then what builds on them
    "__init__": 0,
    "errors": 0,
    "dtypes": 1,
    "threads": 1,
    "deadlines": 1,
    "metrics": 1,
    "atomic_files": 1,
    "progress": 1,
    "digest_algorithms": 1,
    "mixsum": 1,
    "digest": 2,
    "model_dir": 2,
    "synthetic": 2,
    "sharding": 3,
    # pure codec and the store layer
    "codec": 4,
    "store": 4,
    # the protocol and what shares it, the record of a verified state
    "protocol": 5,
    "config": 5,
    "verified": 5,
    # receivers of verified states, and retention
    "state_cache": 6,
    "sinks": 6,
    "retention": 6,
    "rebuild": 6,
    # the daemons and tools
    "publisher": 7,
    "mirror": 7,
    "subscriber": 7,
    "inspect_chain": 7,
    "chain_report": 8,
    "integrations": 8,
    "demo": 9,
    "cli": 10,
    "__main__": 11,
}


def _part(module: str) -> str:
    part = module.split(".")[1] if module.count(".") else "__init__"
    return part if part in LAYERS else "__init__"  # e.g. `from pulsesync import __version__`


def _imports() -> list[tuple[str, str]]:
    """(importing part, imported part) for every pulsesync import in the package, lazy ones included."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).with_suffix("")
        part = relative.parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "pulsesync"]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("pulsesync.") or name == "pulsesync":
                    target = _part(name)
                    if target != "__init__":
                        found.append((part, target))
    return found


def test_every_part_has_a_layer() -> None:
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts == set(LAYERS)


def test_no_import_runs_against_the_layering() -> None:
    upward = sorted({(a, b) for a, b in _imports() if a != b and LAYERS[b] >= LAYERS[a]})
    assert upward == [], f"imports from a part to one at its own or a higher layer: {upward}"


def test_nothing_imports_the_cli() -> None:
    assert [a for a, b in _imports() if b == "cli" and a not in ("cli", "__main__")] == []


def _module_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _module_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, lazy and type-checking imports included.

    `from pkg import name` imports the module pkg.name where that is one, else pkg itself (its
    __init__); a submodule's implicit import of its parent package is no edge of its own.
    """
    modules = {_module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    graph[module].add(name if name in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[module].update(a.name for a in node.names)
        graph[module] = {m for m in graph[module] if m in modules and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(_module_imports()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_test_module_imports_another() -> None:
    """Helpers tests share live in tests/support/ (docs/architecture.md)."""
    tests = Path(__file__).parent
    importing = []
    for path in tests.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_"):
                importing.append((path.name, node.module))
            elif isinstance(node, ast.Import):
                importing += [(path.name, a.name) for a in node.names if a.name.startswith("tests.test_")]
    assert importing == []


# What vLLM loads into its own processes may reach, besides itself and the wire: the foundations.
ENGINE_SIDE_MAY_IMPORT = (
    "pulsesync.sinks.vllm.engine",
    "pulsesync.sinks.vllm.wire",
    "pulsesync.errors",
    "pulsesync.digest",
)


def test_the_vllm_engine_side_imports_only_the_wire_and_the_foundations() -> None:
    """sinks/vllm/engine/ runs inside vLLM: no sidecar, subscriber or store code rides along."""
    graph = _module_imports()
    found = {
        (module, imported)
        for module, imports in graph.items()
        if module.startswith("pulsesync.sinks.vllm.engine")
        for imported in imports
        if not imported.startswith(ENGINE_SIDE_MAY_IMPORT) and imported != "pulsesync.sinks.vllm"
    }
    assert sorted(found) == []


def test_the_vllm_wire_imports_neither_side() -> None:
    graph = _module_imports()
    wire = {m: i for m, i in graph.items() if m.startswith("pulsesync.sinks.vllm.wire")}
    assert wire and not [i for imports in wire.values() for i in imports if i.startswith("pulsesync.sinks.")]


def _calls_in_async_functions() -> list[tuple[str, int, str]]:
    """Where the package takes a lock in a way that can block: `.acquire()` neither awaited (an asyncio
    primitive) nor with blocking=False, anywhere; `with` on a lock or condition inside an `async def`."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        awaited = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Await)}
        for node in ast.walk(tree):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and id(node) not in awaited
            if (
                call
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "acquire"
            ):
                nonblocking = any(k.arg == "blocking" for k in node.keywords) or (
                    node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value is False
                )
                if not nonblocking:
                    found.append((str(path.relative_to(PACKAGE)), node.lineno, "acquire()"))
            if isinstance(node, ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.With):
                        for item in inner.items:
                            held = ast.unparse(item.context_expr)
                            if held.lower().endswith(("lock", "lock()", "_guard", "condition")):
                                found.append((str(path.relative_to(PACKAGE)), inner.lineno, f"with {held}"))
    return found


def test_no_blocking_lock_acquire_on_the_event_loop() -> None:
    """A lock a thread may hold for long is never waited for on the loop (held.py: scopes, not locks)."""
    assert _calls_in_async_functions() == []


def test_the_subscriber_wires_its_parts_and_sinks_come_from_the_registry() -> None:
    """subscriber.py wires the rooms of subscriber/ (<= 200 lines, <= 15 methods); build_sinks branches on no type."""
    path = PACKAGE / "subscriber" / "subscriber.py"
    tree = ast.parse(path.read_text())
    subscriber = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Subscriber")
    methods = [n for n in subscriber.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(path.read_text().splitlines()) <= 200 and len(methods) <= 15
    sinks = ast.parse((PACKAGE / "sinks" / "__init__.py").read_text())
    build = next(n for n in sinks.body if isinstance(n, ast.FunctionDef) and n.name == "build_sinks")
    assert not [n for n in ast.walk(build) if isinstance(n, ast.If)]
