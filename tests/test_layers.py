"""The package's import graph points down the data flow and has no circle. `python tests/test_layers.py` prints
the graph.

Every `dflash_stream` import is read from the source (lazy imports inside functions and type-only imports
included, since both are arrows a reader follows), so a new upward import, or two modules that import each other
through any path, fails here before it tangles the parts.
"""

from __future__ import annotations

import ast
import graphlib
import sys
from collections import defaultdict
from pathlib import Path

import yaml

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_stream"

LAYERS = [
    {"__init__", "config", "diskfull", "errors", "log", "preflight", "rundir", "units"},  # the base every part may use
    {"data"},
    {"target_model"},
    {"regenerate"},  # the target's answers to the data's prompts, from servers, into the response cache
    {"store"},
    {"drafter"},
    {"sizing"},  # the run's sizes from its config: what plan shows and run checks (memory, disk, rates, split)
    {"observe"},  # metrics every role writes; plan, tune, status and report read the parts below
    {"pipeline"},  # the roles wire everything together
    {"bench"},
    {"cli", "__main__"},
]
"""Lowest first: a part may import its own layer and the layers before it in this list, never one after it."""

PENDING: set[str] = set()
"""Upward imports with a fix under way: `max_segment_raw_bytes` moves into the store (issue 13, point 1).
Empty this set as they go; an entry that no longer occurs fails the test, so none lingers."""


def _part(module: str) -> str:
    """`dflash_stream.store.reader` -> `store`; `dflash_stream.config` -> `config`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    for index, layer in enumerate(LAYERS):
        if part in layer:
            return index
    raise AssertionError(f"dflash_stream/{part} is in no layer of tests/test_layers.py: add it to LAYERS")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    names = list(rel.parts)
    if names[-1] == "__init__" and len(names) > 1:
        names.pop()
    return ".".join(names)


def _imports_of(tree: ast.AST, where: str = "<source>") -> set[str]:
    """The dflash_stream modules a parsed module imports, at any depth (functions, `if TYPE_CHECKING:`)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{where}: relative import; the package imports by absolute names"
            base = node.module or ""
            # `from dflash_stream.pipeline import checkpoint` imports the module pipeline.checkpoint, not what
            # pipeline/__init__.py defines; a name that is no submodule comes from the package's __init__.
            folder = PACKAGE.parent / base.replace(".", "/")
            modules = [alias.name for alias in node.names
                       if (folder / f"{alias.name}.py").is_file() or (folder / alias.name / "__init__.py").is_file()]
            targets = [f"{base}.{name}" for name in modules] + ([base] if len(modules) < len(node.names) else [])
        else:
            continue
        found.update(t for t in targets if t == "dflash_stream" or t.startswith("dflash_stream."))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the dflash_stream modules it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        graph[_module_name(path)].update(_imports_of(ast.parse(path.read_text(), str(path)), str(path)))
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items() for target in targets
        if _layer(_part(target)) > _layer(_part(source))
    )


def test_no_part_imports_a_part_above_it():
    upward = set(upward_imports(import_graph()))
    assert not upward - PENDING, "imports pointing up the data flow (see LAYERS):\n  " + "\n  ".join(sorted(upward - PENDING))
    assert not PENDING - upward, f"fixed, so delete from PENDING in tests/test_layers.py: {sorted(PENDING - upward)}"


def test_every_part_has_a_layer():
    for module in import_graph():
        _layer(_part(module))


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles of imports among the package's modules, each as the path that closes it (`a -> b -> a`). Each
    found circle's closing arrow is set aside and the search runs again, so every circle is named once at least."""
    edges = {source: {t for t in targets if t in graph} for source, targets in graph.items()}
    circles = []
    while True:
        try:
            # TopologicalSorter takes {node: predecessors}; a circle is a circle whichever way its arrows point.
            graphlib.TopologicalSorter(edges).prepare()
            return circles
        except graphlib.CycleError as err:
            cycle = list(reversed(err.args[1]))  # importer first: a -> b -> ... -> a
            circles.append(cycle)
            edges[cycle[0]].discard(cycle[1])


def test_no_import_circle():
    circles = import_circles(import_graph())
    assert not circles, "modules that import each other (function-level imports count):\n  " + "\n  ".join(
        " -> ".join(c) for c in circles)


def test_an_import_circle_is_caught():
    """The check itself can fail: a circle through a function-level import, and one through three modules."""
    graph = {"a": {"b"}, "b": {"a", "x"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "x": set()}
    found = [sorted(c[:-1]) for c in import_circles(graph)]
    assert sorted(found) == [["a", "b"], ["c", "d", "e"]]
    source = "def f():\n    from dflash_stream.store.store import Store\n"
    assert {"dflash_stream.store.store"} <= _imports_of(ast.parse(source))


def test_extractor_and_trainer_meet_only_in_the_store():
    graph = import_graph()
    extractor, trainer = "dflash_stream.pipeline.extractor", "dflash_stream.pipeline.trainer"
    assert trainer not in graph[extractor] and extractor not in graph[trainer]


def test_an_upward_import_is_caught():
    """The check itself can fail: a store module importing the pipeline is reported."""
    graph = {"dflash_stream.store.store": {"dflash_stream.pipeline.checkpoint", "dflash_stream.config"}}
    assert upward_imports(graph) == ["dflash_stream.store.store -> dflash_stream.pipeline.checkpoint"]


if __name__ == "__main__":
    # The part-level graph, one arrow per line, upward arrows marked.
    arrows: dict[tuple[str, str], int] = defaultdict(int)
    for source, targets in import_graph().items():
        for target in targets:
            if _part(source) != _part(target):
                arrows[_part(source), _part(target)] += 1
    for (source, target), count in sorted(arrows.items(), key=lambda a: (_layer(a[0][0]), a[0])):
        mark = "   <-- UP" if _layer(target) > _layer(source) else ""
        print(f"{source:>13} -> {target:<13} ({count} import{'s' if count > 1 else ''}){mark}")
    circles = import_circles(import_graph())
    for circle in circles:
        print("circle: " + " -> ".join(circle))
    sys.exit(1 if upward_imports(import_graph()) or circles else 0)


def test_cheap_commands_do_not_import_torch(tmp_path):
    """`store status`, `status`, `audit` and `plan` start in a fraction of a second: none of them imports torch."""
    import subprocess
    import sys

    from dflash_stream.store.store import Store

    Store.open(tmp_path / "store", budget=10**8, codec="lossless", reuse=1,
               fingerprint={"layer_ids": [1, 2], "hidden_size": 64}, max_segment_raw_bytes=10**6)
    # Plain hints plan without transformers; `target.model_type` needs its config class (and so torch) to know the
    # family's layer pattern, which a hybrid's plan is worth the import for.
    headline = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "qwen3.6-27b-4gpu.yaml").read_text())
    del headline["target"]["model_type"]
    config = tmp_path / "hints.yaml"
    config.write_text(yaml.safe_dump(headline))
    for argv in (["store", "status", str(tmp_path / "store")], ["status", str(tmp_path)], ["audit", str(tmp_path)],
                 ["plan", "--config", str(config)]):
        code = ("import sys\nfrom dflash_stream.cli import main\nmain(" + repr(argv) + ")\n"
                "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
        assert out.strip().endswith("NO TORCH"), (argv, out[-500:])
