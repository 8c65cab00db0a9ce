"""ddplab uses torch through its public API only: no patch, no private name, no switch.

Read with ``ast`` over every module of the package (nothing is run): no assignment to an
attribute of torch or of anything imported from it, no ``setattr`` on one, no private torch
name read (``torch.cuda._is_in_bad_fork()``, the CPU-visible probe, aside), no private torch
module imported, and nothing of ``atexit``'s private side. Then the launcher's own pieces that
replaced the patches: its rendezvous handlers come from torch's public registry.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ddplab"
ALLOWED = {("torch", "cuda", "_is_in_bad_fork")}
# What the project's own check greps for before it stops.
PATCHES = re.compile(r"_delay|_create_tcp_store_server|ProcessContext\.join *=|atexit\._|"
                     r"\._composable|\.TCPStore *=")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _chain(node: ast.AST) -> list[str]:
    """``a.b.c`` as ["a", "b", "c"] ([] when the root is not a plain name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return []


def torch_use_problems(source: str) -> list[str]:
    """Every patch of torch and private torch name in ``source`` (one line each)."""
    tree = ast.parse(source)
    bound: dict[str, list[str]] = {}  # local name -> the torch path it stands for
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("torch", "atexit"):
                    name = alias.asname or alias.name.split(".")[0]
                    bound[name] = alias.name.split(".") if alias.asname else [name]
                if alias.name.startswith("torch") and any(map(_private, alias.name.split("."))):
                    problems.append(f"line {node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for alias in node.names:
                path = [*node.module.split("."), alias.name]
                bound[alias.asname or alias.name] = path
                if any(map(_private, path)):
                    problems.append(f"line {node.lineno}: imports {'.'.join(path)}")
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and _chain(node.func) in (["setattr"], ["delattr"]):
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        for target in targets:
            chain = _chain(target) if isinstance(target, ast.Attribute) else []
            if chain and chain[0] in bound and bound[chain[0]][0] == "torch":
                problems.append(f"line {node.lineno}: assigns to {'.'.join(chain)}")
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in bound:
                path = [*bound[chain[0]], *chain[1:]]
                private = [p for p in path if _private(p)]
                if private and tuple(path) not in ALLOWED and \
                        tuple(path[:3]) not in ALLOWED:
                    problems.append(f"line {node.lineno}: reads {'.'.join(path)}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                re.fullmatch(r"torch(\.\w+)*\._\w+(\.\w+)*", node.value) and \
                node.value != "torch._dynamo":  # preloaded by name: DDP imports it anyway
            problems.append(f"line {node.lineno}: names {node.value}")
    return sorted(set(problems))


def test_the_checker_finds_what_it_looks_for():
    patched = (
        "import atexit\n"
        "from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic\n"
        "import torch.multiprocessing.spawn as spawn\n"
        "from torch.distributed._composable.fsdp import fully_shard\n"
        "dynamic._delay = print\n"
        "spawn.ProcessContext.join = print\n"
        "setattr(dynamic, 'get_method_name', print)\n"
        "atexit._clear()\n"
        "import torch\n"
        "torch.cuda._lazy_init()\n"
        "ok = torch.cuda._is_in_bad_fork()\n"
    )
    found = "\n".join(torch_use_problems(patched))
    for expected in ("assigns to dynamic._delay", "assigns to spawn.ProcessContext.join",
                     "assigns to dynamic.?", "reads atexit._clear", "reads torch.cuda._lazy_init",
                     "imports torch.distributed._composable.fsdp.fully_shard"):
        assert expected in found, found
    assert "_is_in_bad_fork" not in found


def test_no_module_of_ddplab_patches_torch_or_reads_a_private_torch_name():
    problems = {str(path.relative_to(PACKAGE)): found for path in sorted(PACKAGE.rglob("*.py"))
                if (found := torch_use_problems(path.read_text()))}
    assert problems == {}


def notebook_sources(notebook: Path) -> list[tuple[int, str]]:
    """Each code cell of ``notebook`` as Python: IPython's magics and shell lines blanked, a
    ``%%writefile`` cell's file kept, other cell magics left out."""
    cells = []
    for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        lines = "".join(cell["source"]).split("\n") if cell["cell_type"] == "code" else [""]
        if lines[0].startswith("%%"):
            if not lines[0].startswith("%%writefile"):
                continue
            lines[0] = ""
        cells.append((index, "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                       for line in lines)))
    return cells


def test_the_notebook_reader_keeps_python_and_written_files():
    import tempfile

    cells = [{"cell_type": "code", "source": ["%%writefile w.py\n", "import torch._C\n"]},
             {"cell_type": "code", "source": ["%%bash\n", "torch._x\n"]},
             {"cell_type": "code", "source": ["!ls\n", "import torch\n", "torch.cuda._lazy_init()"]},
             {"cell_type": "markdown", "source": ["torch._y"]}]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "n.ipynb"
        path.write_text(json.dumps({"cells": cells}))
        found = {i: torch_use_problems(source) for i, source in notebook_sources(path)}
    assert found == {0: ["line 2: imports torch._C"], 2: ["line 3: reads torch.cuda._lazy_init"],
                     3: []}


def test_no_notebook_patches_torch_or_names_a_private_torch_object():
    """The lessons' cells, proofs and written workers too: torch's source is read as text."""
    problems = {f"{path.name} cell {index}": found
                for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb"))
                for index, source in notebook_sources(path)
                if (found := torch_use_problems(source))}
    assert problems == {}


def test_the_projects_grep_finds_nothing_and_no_switch_turns_a_fix_off():
    hits = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if PATCHES.search(line) or "DDPLAB_TORCH_PATCHES" in line]
    assert hits == []


HANDLER = """
import json
from datetime import timedelta
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from ddplab.launcher import agent

rendezvous_handler_registry.register(agent.RDZV_BACKEND, agent._one_node_handler())
handler = rendezvous_handler_registry.create_handler(RendezvousParameters(
    backend="ddplab", endpoint="127.0.0.1:0", run_id="one", min_nodes=1, max_nodes=1))
info = handler.next_rendezvous()
info.store.set("from the agent", "kept")
where = info.bootstrap_store_info
handler.num_nodes_waiting()  # (torch's monitor loop, once the ranks are forked: served now)
worker = TCPStore(where.master_addr, where.master_port, None, False, timedelta(seconds=10))
worker.set("from a worker", "seen")
seen = worker.get("from a worker").decode()
again = handler.next_rendezvous().bootstrap_store_info  # a restarted round
try:  # the first round's store no longer answers (its port may already serve another process)
    old = TCPStore(where.master_addr, where.master_port, None, False, timedelta(seconds=2))
    old_gone = old.get("from a worker") != b"seen"
except Exception:
    old_gone = True
print(json.dumps([info.rank, info.world_size, handler.use_agent_store,
                  info.store.get("from the agent").decode(), where.master_addr,
                  seen, again.master_port != where.master_port,
                  old_gone]))
"""


def test_the_rendezvous_handler_comes_from_torchs_public_registry():
    """The agent's store is in-process (no server thread in the process that forks the ranks);
    each round the agent serves a fresh workers' store once the ranks are forked, on loopback
    here."""
    out = subprocess.run([sys.executable, "-c", HANDLER], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [0, 1, True, "kept", "127.0.0.1", "seen",
                                                       True, True]
