"""The package's shape, checked from its source: layers without cycles, one home per concept."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from hybriddl.hosts.compression import REGISTRY
from hybriddl.strategies import STRATEGIES

PACKAGE = Path(__file__).resolve().parent.parent / "hybriddl"
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_statements(tree: ast.AST):
    """Every import, at any depth (function-level ones too), but those under
    `if TYPE_CHECKING:`, which never run."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """hybriddl modules `path` imports."""
    return imported_from(ast.parse(path.read_text()), known)


def imported_from(tree: ast.AST, known) -> set[str]:
    found = set()
    for node in import_statements(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.module and node.level == 0:
            # `from pkg import module` imports the module; `from module import name` the module
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, known) - {name} for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert "hybriddl.run.trainer" in graph and graph["hybriddl.run.trainer"]
    assert find_cycle(graph) is None


def room(module: str) -> str:
    """The folder or top-level module a module lives in: hybriddl.run.trainer -> run,
    hybriddl.files -> files, hybriddl itself -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_table(text: str) -> dict[str, int]:
    """ARCHITECTURE.md's layers: folder or top-level module -> its layer (1 = the bottom)."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            for name in re.findall(r"`([\w.]+/?)`", cells[2]):
                layers[name.removesuffix("/").removesuffix(".py")] = int(cells[0])
    return layers


def imports_up(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return [f"{module} (layer {layers[room(module)]}) imports {target} "
            f"(layer {layers[room(target)]})"
            for module, targets in sorted(graph.items()) for target in sorted(targets)
            if layers[room(target)] > layers[room(module)]]


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {room(module): set() for module in graph}
    for module, targets in graph.items():
        rooms[room(module)] |= {room(target) for target in targets} - {room(module)}
    return rooms


def test_every_module_has_a_layer_in_architecture_md():
    layers = layer_table(ARCHITECTURE.read_text())
    rooms = {room(module) for module in modules()}
    assert rooms - set(layers) == set(), "add these to ARCHITECTURE.md's layer table"
    assert set(layers) - rooms == set(), "ARCHITECTURE.md's layer table names what is not there"


def test_no_module_imports_a_higher_layer():
    assert imports_up(import_graph(), layer_table(ARCHITECTURE.read_text())) == []


def test_no_folders_import_each_other_round_a_circle():
    assert find_cycle(room_graph(import_graph())) is None


def test_layer_checks_see_an_import_up_and_a_circle_of_folders():
    graph = {"hybriddl.files": {"hybriddl.run.trainer"}, "hybriddl.run.trainer": set()}
    assert imports_up(graph, {"files": 1, "run": 7}) == [
        "hybriddl.files (layer 1) imports hybriddl.run.trainer (layer 7)"]
    folders = {"hybriddl.run.trainer": {"hybriddl.tuning.benchmark"},
               "hybriddl.tuning.benchmark": {"hybriddl.run.step"}, "hybriddl.run.step": set()}
    assert find_cycle(room_graph(folders)) == ["run", "tuning", "run"]
    table = "x\n## Layers\n\n| 1 | bottom | `files.py`, `machine/` | w `x.py` |\n\n## Next\n| 2 | n | `cli.py` |"
    assert layer_table(table) == {"files": 1, "machine": 1}


def test_imports_under_type_checking_are_not_counted():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hybriddl.cli\n"
                     "def f():\n    import hybriddl.files\n")
    assert imported_from(tree, {"hybriddl.cli": None, "hybriddl.files": None}) == {"hybriddl.files"}


def test_only_the_host_layer_imports_mpi4py():
    importers = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mpi4py"
                                                    for a in node.names):
                importers.add(name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpi4py":
                importers.add(name)
    assert importers, "nothing imports mpi4py: the check would prove nothing"
    assert {name for name in importers if not name.startswith("hybriddl.hosts.")} == set()


def not_strategy_names(tree: ast.AST) -> set[int]:
    """Strings that only look like a strategy's name: dict keys ({"threads": 4} counts
    threads) and file column headers (pidstat's "threads" column)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            ids.update(id(key) for key in node.keys if key is not None)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_COLUMNS")
                                                for t in node.targets):
            ids.update(id(n) for n in ast.walk(node.value))
    return ids


def test_no_strategy_name_literal_outside_strategies():
    names = set(STRATEGIES)
    found = []
    for name, path in modules().items():
        if name == "hybriddl.strategies" or name.startswith("hybriddl.strategies."):
            continue
        tree = ast.parse(path.read_text())
        skip = not_strategy_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip:
                found.append(f"{name}:{node.lineno}: {node.value!r}")
    assert found == []


def test_strategy_name_check_sees_a_literal():
    tree = ast.parse('best = "threads"\nrow = {"threads": 2}')
    skip = not_strategy_names(tree)
    flagged = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and n.value in STRATEGIES and id(n) not in skip]
    assert flagged == ["threads"]


def not_scheme_names(tree: ast.AST) -> set[int]:
    """Strings that only look like a wire scheme's word: dict keys, another function's
    keyword (torch's `reduction="none"`), another option's value in a command line
    (mpirun's `"--bind-to", "none"`) and a word shown for nothing (`names or "none"`,
    `"none" if seen else None`)."""
    ids = set(not_strategy_names(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and "compression" not in (node.arg or ""):
            ids.add(id(node.value))
        if isinstance(node, (ast.List, ast.Tuple)):
            for flag, value in zip(node.elts, node.elts[1:]):
                if isinstance(flag, ast.Constant) and str(flag.value).startswith("--") \
                        and flag.value != "--compression":
                    ids.add(id(value))
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            ids.add(id(node.values[-1]))
        if isinstance(node, ast.IfExp) and isinstance(node.orelse, ast.Constant) \
                and node.orelse.value is None:
            ids.add(id(node.body))
    return ids


def is_scheme_name(value) -> bool:
    """A registered scheme's word, alone or with its parameters ("powersgd:2")."""
    return isinstance(value, str) and any(value == name or value.startswith(f"{name}:")
                                          for name in REGISTRY)


def scheme_name_literals(tree: ast.AST) -> list[ast.Constant]:
    skip = not_scheme_names(tree)
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and is_scheme_name(node.value) and id(node) not in skip]


def test_no_scheme_name_literal_outside_its_module_and_the_registry():
    """The planner, the averaging, the settings and compare ask the scheme objects (or
    name them by their classes' `name`, EXACT for the default), never spell them."""
    homes = {"hybriddl.hosts.compression", "hybriddl.hosts.scheme",
             *(cls.__module__ for cls in REGISTRY.values())}
    found = []
    for name, path in modules().items():
        if name in homes:
            continue
        found += [f"{name}:{node.lineno}: {node.value!r}"
                  for node in scheme_name_literals(ast.parse(path.read_text()))]
    assert found == []


def test_scheme_name_check_sees_a_literal():
    tree = ast.parse('if compression != "none" and c == "fp16":\n'
                     '    x = f"powersgd:{rank}"\n'
                     'loss(reduction="none")\nargv = ["--bind-to", "none"]\n'
                     'row = {"fp16": 2}\nshown = names or "none"')
    assert [n.value for n in scheme_name_literals(tree)] == ["none", "fp16", "powersgd:"]


# What computing looks like in a call: building a model, a step, a collective.
COMPUTING_CALLS = {"build_model", "optimizer_step", "compute_gradients", "backward",
                   "allgather_rows", "allreduce_sum", "broadcast_parameters"}


def computing_calls(tree: ast.AST) -> set[str]:
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
              for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return called & COMPUTING_CALLS


def test_the_cli_parses_and_displays_and_never_trains_or_sends():
    """cli/ may import the library, but none of its modules builds a model, runs a step or
    calls a collective itself."""
    found = {name: sorted(computing_calls(ast.parse(path.read_text())))
             for name, path in modules().items() if room(name) == "cli"}
    assert len(found) > 5, "cli/ holds one module per command"
    assert {name: calls for name, calls in found.items() if calls} == {}


def argparse_importers(trees: dict[str, ast.AST]) -> set[str]:
    """Modules that import argparse (`if TYPE_CHECKING:` blocks aside)."""
    return {name for name, tree in trees.items() for node in import_statements(tree)
            if (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names))
            or (isinstance(node, ast.ImportFrom) and node.module == "argparse")}


def test_only_the_cli_reads_flags():
    """The cli parses, the library computes: flags are defined and turned into settings in
    cli/ alone (flags.py, settings.py), so no library module sees an argparse Namespace."""
    trees = {name: ast.parse(path.read_text()) for name, path in modules().items()}
    importers = argparse_importers(trees)
    assert "hybriddl.cli.flags" in importers, "nothing imports argparse: the check would prove nothing"
    assert {name for name in importers if room(name) != "cli"} == set()


def test_argparse_check_sees_an_import():
    trees = {"hybriddl.run.a": ast.parse("import argparse"),
             "hybriddl.run.b": ast.parse("from argparse import Namespace"),
             "hybriddl.run.c": ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    import argparse\n")}
    assert argparse_importers(trees) == {"hybriddl.run.a", "hybriddl.run.b"}


def test_computing_calls_are_seen():
    assert computing_calls(ast.parse("loss.backward()\nmodel = build_model('vgg16', 3)")) == {
        "backward", "build_model"}


TESTS = Path(__file__).resolve().parent

# What a test module does, seen in its source, and the markers that must say so (setup.cfg
# registers them; `-m "not slow and not mpi and not emulated and not slurm"` is the quick loop).
NAMES_NEED = {
    "MPIRUN": {"mpi"},                                # mpirun beside the interpreter
    "hosts_launcher": {"mpi", "emulated"},            # mpirun, on emulated hosts where it can
    "EmulatedHosts": {"root", "emulated"},
    "can_emulate": {"root", "emulated"},
    "geteuid": {"root"},
}
COMMANDS_NEED = {  # string literals: a command line's words
    "emulate": {"mpi", "emulated"},   # hybriddl emulate
    "compare": {"mpi", "emulated"},   # hybriddl compare runs its contenders on emulated hosts
    "launch": {"mpi"},                # hybriddl launch supervises mpirun
    "sbatch": {"slurm"},
    "srun": {"slurm"},
}
# Modules that ask who they run as without needing root: the reason stands beside each.
ROOT_AWARE = {
    "test_bad_images.py": "as root, open() ignores mode bits, so the test refuses it itself",
    "test_pace.py": "EmulatedHosts is only made for its mpirun options: no namespace, no host",
}
# Modules that name a command without starting what it starts: the reason stands beside each.
COMMAND_AWARE = {
    "test_cli.py": "emulate and launch are given bad input, refused before any mpirun",
    "test_bad_input.py": "emulate, launch and compare are given a place they cannot write "
                         "to or a missing command, refused before any host starts",
    "test_pace.py": "emulate is given a bad --compression-seconds, refused before any host; "
                    "EmulatedHosts gives its mpirun options and starts nothing",
}


def markers_needed(tree: ast.AST) -> set[str]:
    needed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            needed |= NAMES_NEED.get(node.id, set())
        elif isinstance(node, ast.Attribute):
            needed |= NAMES_NEED.get(node.attr, set())
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                needed |= NAMES_NEED.get(alias.name, set())
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            needed |= COMMANDS_NEED.get(node.value, set())
    return needed


def markers_used(tree: ast.AST) -> set[str]:
    """`pytest.mark.NAME` anywhere: in `pytestmark`, on a test, or on a parameter."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "pytest"}


def test_every_test_module_is_marked_for_what_it_starts():
    unmarked = []
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name == Path(__file__).name:  # its tables name the commands, it runs none
            continue
        tree = ast.parse(path.read_text())
        missing = markers_needed(tree) - markers_used(tree)
        if path.name in ROOT_AWARE:
            missing.discard("root")
        if path.name in COMMAND_AWARE:
            missing -= {"mpi", "emulated"}
        if missing:
            unmarked.append(f"{path.name}: {sorted(missing)}")
    assert unmarked == []


HOST_HOLDERS = {"hosts_launcher", "EmulatedHosts"}


def fixtures_holding_hosts(tree: ast.AST) -> list[str]:
    """Fixtures wider than one test (scope module, package or session) that make emulated
    hosts: they live from a module's first test to its last, where tests/two_at_once.py
    must give the module the machine alone (marker `holds_hosts`)."""
    def wide(decorator: ast.expr) -> bool:
        return (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr == "fixture"
                and any(k.arg == "scope" and isinstance(k.value, ast.Constant)
                        and k.value.value != "function" for k in decorator.keywords))
    return [node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and any(map(wide, node.decorator_list))
            and any(isinstance(n, ast.Name) and n.id in HOST_HOLDERS for n in ast.walk(node))]


def test_a_module_whose_fixture_holds_hosts_runs_alone_to_its_end():
    unmarked = [f"{path.name}: {fixtures}" for path in sorted(TESTS.glob("test_*.py"))
                if (fixtures := fixtures_holding_hosts(tree := ast.parse(path.read_text())))
                and "holds_hosts" not in markers_used(tree)]
    assert unmarked == []


def test_holder_check_sees_a_module_fixture_and_not_a_test_s_own():
    tree = ast.parse('import pytest\n\n@pytest.fixture(scope="module")\ndef launcher():\n'
                     '    with hosts_launcher(3) as held:\n        yield held\n\n'
                     '@pytest.fixture\ndef mine():\n    with EmulatedHosts(2) as held:\n'
                     '        yield held\n')
    assert fixtures_holding_hosts(tree) == ["launcher"]


def test_marker_check_sees_an_unmarked_mpirun():
    tree = ast.parse('import subprocess\nfrom emulated import MPIRUN\n\n'
                     'def test_two_ranks():\n    subprocess.run([str(MPIRUN), "-np", "2", "true"])\n')
    assert markers_needed(tree) - markers_used(tree) == {"mpi"}
    marked = ast.parse("import pytest\npytestmark = [pytest.mark.mpi]\n")
    assert markers_used(marked) == {"mpi"}
