"""Two sides, one seam: which side every ddplab module is on, and what it may import.

The rule ("two sides, one seam", README's layout): the kernel side runs in the notebook or
the CLI, the worker side in each rank; ``events`` and ``env`` are the seam both sides speak,
with ``versions`` and ``torch_words`` (torch's message patterns, stdlib only) beside them.
Inside the package the kernel side never imports the worker side and the other way round
(notebooks may call both), worker-side layers point downwards only, and nothing imports in a
cycle. Imports are read with ``ast`` (those inside functions count too), so nothing is run.

A new module must be added to ``SIDES`` below: the test fails until it says which side it is on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddplab"

SEAM = {"events", "env", "versions", "torch_words"}

# Module (or subpackage: every module in it) -> side.
SIDES = {
    # kernel side: the notebook's and the CLI's process
    # the launcher, and lab/: what only notebooks call (widgets, plots, checks, judges, demos, ...)
    "__main__": "kernel", "cli": "kernel", "launcher": "kernel", "lab": "kernel",
    "workspace": "kernel", "flight_recorder": "kernel", "failures": "kernel",
    "liveview": "kernel",
    # worker side: runs in each rank
    "workers": "worker", "train": "worker", "data": "worker", "models": "worker",
    "checkpoint": "worker", "dist": "worker", "amp": "worker", "schedule": "worker",
    "pinning": "worker", "capstone": "worker", "sharded": "worker", "loops": "worker",
    "pipelining": "worker",
    # the seam
    "events": "seam", "env": "seam", "versions": "seam", "torch_words": "seam",
}

# Worker-side layers, bottom first: a module imports only modules of a lower layer.
# (dist and checkpoint import no ddplab module at all: students copy them alone.)
LAYERS = [
    {"versions", "torch_words"},
    {"events", "env"},
    {"dist", "checkpoint", "amp", "schedule", "models", "sharded"},
    {"data", "pinning"},
    {"train", "loops", "pipelining"},
    {"capstone"},
    {"workers"},
]


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name below ``ddplab`` (``workers.train``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = modules()


def imported(name: str) -> set[str]:
    """The ddplab modules that module ``name`` imports, anywhere in its code."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "":
        package = []
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(a.name.removeprefix("ddplab.") for a in node.names
                           if a.name.startswith("ddplab."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "ddplab" or node.module.startswith("ddplab.")):
                module = node.module.removeprefix("ddplab").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from ddplab import dist` names a module
                candidate = f"{module}.{alias.name}" if module else alias.name
                targets.add(candidate if candidate in MODULES else module)
    return {_resolve(t) for t in targets} - {""}


def _resolve(target: str) -> str:
    """The module a dotted target lives in (``dist.setup`` -> ``dist``)."""
    parts = target.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts)


def side(name: str) -> str:
    return SIDES.get(name.split(".")[0], "unknown")


def layer(name: str) -> int:
    top = name.split(".")[0]
    return next(i for i, members in enumerate(LAYERS) if top in members)


PACKAGED = sorted(n for n in MODULES if n)


def test_every_module_has_a_side() -> None:
    unknown = sorted({n.split(".")[0] for n in PACKAGED} - set(SIDES))
    assert not unknown, f"add these modules to SIDES in {__file__}: {unknown}"
    assert {n for n in SIDES if SIDES[n] == "seam"} == SEAM


def test_the_package_itself_imports_nothing_eagerly() -> None:
    """``import ddplab`` (done by every worker that imports ``ddplab.dist``) stays light."""
    assert imported("") == set()


@pytest.mark.parametrize("name", PACKAGED)
def test_no_import_crosses_the_seam(name: str) -> None:
    crossing = {t for t in imported(name) if side(t) not in ("seam", side(name))}
    assert not crossing, f"{side(name)}-side {name} imports {sorted(crossing)}"


@pytest.mark.parametrize("name", [n for n in PACKAGED if side(n) in ("worker", "seam")])
def test_worker_side_imports_point_downwards(name: str) -> None:
    upwards = {t for t in imported(name) if layer(t) >= layer(name)}
    assert not upwards, f"{name} (layer {layer(name)}) imports {sorted(upwards)}"


def test_no_import_cycles() -> None:
    graph = {n: imported(n) - {n} for n in PACKAGED}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in PACKAGED:
        if name not in state:
            visit(name, [name])


def test_the_reader_sees_what_the_rule_sees() -> None:
    """The import reader itself: it finds the imports these modules are known to have."""
    assert imported("workers.train") >= {"train", "data", "dist", "models", "checkpoint"}
    assert "events" in imported("launcher.output")  # `from .. import events as _events`
    assert "launcher.api" in imported("lab.bench")  # `from ..launcher.api import launch`
    assert imported("dist") == set() and imported("checkpoint") == set()
    assert imported("lab.demos.saving") == {"lab.demos", "lab.demos.dataparallel"}
    assert "lab.demos.sampling" in imported("lab.widgets")  # imported inside a function


def test_torch_words_is_stdlib_only() -> None:
    """Both sides import the pattern module, so it imports nothing but the standard library."""
    import sys

    tree = ast.parse(MODULES["torch_words"].read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    assert names and names <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


def test_the_launcher_imports_nothing_of_the_course_helpers() -> None:
    """``ddplab.launcher`` stands below ``ddplab.lab``: a launch shows itself through
    ``ddplab.liveview``, and no launcher module reaches up into the notebooks' helpers."""
    launcher = [name for name in MODULES if name == "launcher" or name.startswith("launcher.")]
    assert len(launcher) > 5
    for name in launcher:
        assert not {m for m in imported(name) if m == "lab" or m.startswith("lab.")}, name
    assert "liveview" in imported("launcher.api")
