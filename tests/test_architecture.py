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
    "mixsum": 1,
    "digest": 2,
    "model_dir": 2,
    "synthetic": 2,
    "verified": 3,
    "sharding": 3,
    # pure codec and the store layer
    "codec": 4,
    "store": 4,
    # the protocol and what shares it
    "protocol": 5,
    "config": 5,
    "state_cache": 5,
    # receivers of verified states, and retention
    "sinks": 6,
    "retention": 6,
    # the daemons and tools
    "publisher": 7,
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
