"""The package's layers hold: a lower layer never imports a higher one, and no module imports itself
through others. Both count function-local imports, which a deferred import would otherwise hide, and
leave out imports under ``if TYPE_CHECKING:``, which never run.

The layers are the import-linter contract in pyproject.toml (``[tool.importlinter]``); the cycle
check walks the same import graph (grimp's, which import-linter builds on).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="needs the dev extra (import-linter)")

ROOT = Path(__file__).resolve().parents[1]


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_lower_layers_never_import_higher_ones():
    lint = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "1 kept, 0 broken" in lint.stdout


def test_no_import_cycles():
    graph = grimp.build_graph("posttrain", cache_dir=None, exclude_type_checking_imports=True)  # annotations only
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    class Graph:  # a -> b -> c -> a, and d -> a outside the cycle
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, module):
            return self.edges.get(module, set())

    assert import_cycles(Graph()) == [["a", "b", "c"]]
