"""The layers of the code (docs/architecture.md) hold: no import cycle among the project's
modules, and each layer imports only those below it. The protocol (scheduler_core, what
producer and consumer build on) never imports the operator tooling (scheduler_core.ops),
so `import producer` in a web app and a consumer's loop load the protocol only. Read from
the source: every import a module can run, at its top or inside a function."""

from __future__ import annotations

import pytest
from helpers.imports import cycles, import_graph, reachable

GRAPH = import_graph()
OPS = "scheduler_core.ops"
# What each layer may import, itself included. bench/ (run from a checkout) may use any;
# nothing installed may import it.
MAY_IMPORT = {
    "scheduler_core": {"scheduler_core"},
    OPS: {"scheduler_core", OPS},
    "producer": {"scheduler_core", OPS, "producer"},
    "consumer": {"scheduler_core", OPS, "consumer"},
    "batchgate": {"scheduler_core", OPS, "producer", "consumer", "batchgate"},
    "bench": {"scheduler_core", OPS, "producer", "consumer", "batchgate", "bench"},
}
# Cycles known when this test was written, each with what removes it. A fixed one must
# leave this list (the test fails on an entry that no longer holds).
KNOWN_CYCLES = [
]


def layer(module: str) -> str:
    return OPS if module == OPS or module.startswith(OPS + ".") else module.split(".")[0]


def test_the_graph_covers_every_layer() -> None:
    present = {layer(module) for module in GRAPH}
    assert {"scheduler_core", OPS, "producer", "consumer", "batchgate"} <= present
    assert GRAPH["scheduler_core.ops.stats"] >= {"scheduler_core.ops.reading"}


def test_no_import_cycle() -> None:
    found = cycles(GRAPH)
    unknown = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unknown, f"import cycles: {unknown}"
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"no longer cycles, remove from KNOWN_CYCLES: {stale}"


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_each_layer_imports_only_those_below(name: str) -> None:
    wrong = sorted(f"{module} -> {target}" for module, targets in GRAPH.items()
                   if layer(module) == name
                   for target in targets if layer(target) not in MAY_IMPORT[name])
    assert not wrong, f"{name} may import only {sorted(MAY_IMPORT[name])}: {wrong}"


@pytest.mark.parametrize("start", ["producer", "consumer", "consumer.worker",
                                   "consumer.sharded"])
def test_the_libraries_load_the_protocol_only(start: str) -> None:
    """What a web app (`import producer`) and a consumer's loop load: no tooling."""
    tooling = sorted(m for m in reachable(GRAPH, start) if layer(m) == OPS)
    assert not tooling, f"importing {start} loads {tooling}"
