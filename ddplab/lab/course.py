"""The notebooks as files: execute them all into ``build/``, or strip them for committing.

``python -m ddplab course`` runs every notebook in ``notebooks/`` of the course folder here (a
clone, or a folder written by ``ddplab init``) top to bottom in a fresh kernel and writes the
executed copies (with outputs, for reading) to its ``build/notebooks/``.
``python -m ddplab course --strip [FILES]`` removes outputs, execution counts and volatile
metadata in place, which is how notebooks are committed (``make strip``).

Lessons: all (this is how the course itself is built and checked).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..workspace import NOTEBOOK_GLOB, find_course

# Only the kernel to start: language_info (the Python version of the last run) is rewritten by
# every run, so keeping it would make a run and a strip differ from the committed file.
KEEP_METADATA = {"kernelspec"}
# A cell keeps its tags (nbval's) and its ``jupyter`` view state: ``source_hidden`` collapses a
# cell that only asserts the course's own claims (JupyterLab hides it, nbval still runs it).
KEEP_CELL_METADATA = {"tags", "jupyter"}


def strip(nb: dict[str, Any]) -> dict[str, Any]:
    """Return ``nb`` without outputs, execution counts or volatile metadata (nbformat JSON)."""
    nb["metadata"] = {k: v for k, v in nb.get("metadata", {}).items() if k in KEEP_METADATA}
    nb["metadata"]["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                    "name": "python3"}
    for cell in nb.get("cells", []):
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items()
                            if k in KEEP_CELL_METADATA}
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    return nb


def is_stripped(nb: dict[str, Any]) -> bool:
    """True when ``nb`` is exactly as ``strip`` would leave it."""
    return json.dumps(nb, sort_keys=True) == json.dumps(strip(json.loads(json.dumps(nb))),
                                                        sort_keys=True)


def strip_files(paths: Sequence[Path]) -> list[Path]:
    """Strip notebooks in place; return those that changed."""
    changed = []
    for path in paths:
        nb = json.loads(path.read_text())
        if not is_stripped(nb):
            path.write_text(json.dumps(strip(nb), indent=1, ensure_ascii=False) + "\n")
            changed.append(path)
    return changed


def execute(path: Path, out_dir: Path, timeout: int = 900) -> float:
    """Execute one notebook in a fresh kernel (in ``notebooks/``) and save it with outputs."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
    return time.monotonic() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ddplab course [--strip] [--out DIR] [NOTEBOOK ...]``."""
    parser = argparse.ArgumentParser(prog="python -m ddplab course")
    parser.add_argument("--strip", action="store_true", help="strip in place instead")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the executed copies go (default: build/notebooks in the "
                             "course folder)")
    parser.add_argument("notebooks", nargs="*", type=Path)
    ns = parser.parse_args(argv)
    course = find_course()
    if course is None and (not ns.notebooks or ns.out is None and not ns.strip):
        parser.error("no course folder here (one holding notebooks/ and exercises/): run it "
                     "inside a clone or a folder written by `ddplab init`, or name the notebooks "
                     "and --out")
    paths = ns.notebooks or sorted((course / "notebooks").glob(NOTEBOOK_GLOB))
    if ns.out is None and course is not None:
        ns.out = course / "build" / "notebooks"
    if ns.strip:
        for path in strip_files(paths):
            print(f"stripped {path}")
        return 0
    for path in paths:
        print(f"{path.name}: {execute(path, ns.out):.1f} s -> {ns.out / path.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
