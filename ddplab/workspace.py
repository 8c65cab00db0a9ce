"""The learner's course folder: ``ddplab init`` writes it, ``ddplab lab`` opens it.

A course folder holds ``notebooks/`` (the lessons), ``exercises/`` (the files the learner
edits; the notebooks launch them as ``../exercises/NAME.py``) and ``results/`` (what one notebook
leaves for another, such as 01's baseline). A clone of the repository is a course folder too.
The pristine files ship inside the package (``ddplab/_course``, copied there when the wheel is
built) or, in a clone, sit beside it. Nothing is ever written inside the installed package.

Example::

    python -m ddplab init my-course      # or: ddplab init my-course
    ddplab lab my-course                 # JupyterLab on 127.0.0.1, in that folder

Lessons: all (where the notebooks, the exercises and the results live).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

PACKAGE = Path(__file__).resolve().parent
#: The learner's course folder when none is given: ``./ddplab-course``.
DEFAULT_DIR = "ddplab-course"
#: The course's JupyterLab settings (``labconfig/default_setting_overrides.json``: no "official
#: Jupyter news?" pop-up, no update check), shipped with the package. JupyterLab reads
#: ``<folder>/labconfig/`` of every folder on ``JUPYTER_CONFIG_PATH``; ``ddplab lab`` and
#: ``make lab`` put this one first.
LAB_CONFIG = PACKAGE / "lab" / "jupyter"
#: What ``init`` copies: folder -> file pattern.
#: The course's notebooks: a lesson's number, a letter for a lesson's second notebook
#: (``03_ddp_spawn``, then ``03b_ddp_internals``); sorted by name, they are in teaching order.
NOTEBOOK_GLOB = "[0-9][0-9]*_*.ipynb"
COURSE_FILES = {"notebooks": NOTEBOOK_GLOB, "exercises": "*.py"}
#: What ``init`` wrote, file -> sha256, so a later ``init`` can tell a learner's edit from an
#: older shipped version (which it refreshes).
MANIFEST = ".ddplab-init.json"


def shipped_dir() -> Path:
    """The folder holding the pristine ``notebooks/`` and ``exercises/``.

    Inside an installed wheel that is ``ddplab/_course``; in a clone (or an editable install)
    the repository itself.

    Raises:
        FileNotFoundError: neither exists (a broken install); the message says what to do.
    """
    for folder in (PACKAGE / "_course", PACKAGE.parent):
        if all((folder / name).is_dir() for name in COURSE_FILES):
            return folder
    raise FileNotFoundError(
        f"the course files are missing from {PACKAGE}: reinstall ddplab from a built wheel "
        "(pip install ddplab) or run from a clone of the repository.")


def shipped_files() -> dict[str, Path]:
    """Every file ``init`` writes, as ``{"notebooks/01_single_gpu.ipynb": source path}``."""
    root = shipped_dir()
    return {f"{folder}/{path.name}": path
            for folder, pattern in COURSE_FILES.items()
            for path in sorted((root / folder).glob(pattern))}


def _inside_package(path: Path) -> bool:
    return path == PACKAGE or PACKAGE in path.parents


def find_course(start: Optional[os.PathLike] = None) -> Optional[Path]:
    """The course folder that holds ``start`` (default: the working directory), or None.

    That is the nearest of ``start`` and its parents holding both ``notebooks/`` and
    ``exercises/``: a notebook's kernel runs in ``notebooks/``, so its course folder is the one
    above. The pristine copy inside the installed package never counts.
    """
    here = Path(start if start is not None else os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if all((folder / name).is_dir() for name in COURSE_FILES):
            return None if _inside_package(folder) else folder
    return None


def exercises_dir() -> Path:
    """The learner's ``exercises/`` (in the course folder of the working directory).

    Outside any course folder: the pristine skeletons that ship with ddplab.
    """
    course = find_course()
    return (course if course is not None else shipped_dir()) / "exercises"


def user_dir() -> Path:
    """ddplab's folder in the user's data directory (platformdirs), for runs outside a course."""
    import platformdirs

    return Path(platformdirs.user_data_dir("ddplab", appauthor=False))


def results_dir() -> Path:
    """Where notebooks keep small results for later notebooks.

    ``$DDPLAB_RESULTS`` when set; else ``results/`` in the course folder (beside
    ``notebooks/``); else ``results/`` in the user's data directory (``user_dir``).

    Lesson: 01 (the baseline), 02, 03, 09 (which read it).
    """
    if os.environ.get("DDPLAB_RESULTS"):
        return Path(os.environ["DDPLAB_RESULTS"])
    course = find_course()
    return (course if course is not None else user_dir()) / "results"


# --------------------------------------------------------------------------- ddplab init


@dataclass
class InitReport:
    """What ``init`` did to each file (paths relative to the course folder)."""

    folder: Path
    written: list[str] = field(default_factory=list)    # new files
    refreshed: list[str] = field(default_factory=list)  # unchanged by the learner, now updated
    unchanged: list[str] = field(default_factory=list)  # already the shipped version
    kept: list[str] = field(default_factory=list)       # changed by the learner: left alone


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def init(folder: os.PathLike = DEFAULT_DIR) -> InitReport:
    """Write the notebooks and exercises into ``folder``; never overwrite a learner's change.

    A file that is missing is written. A file that differs from the shipped one is refreshed
    only when it is exactly what an earlier ``init`` wrote (an older ddplab's version);
    otherwise the learner changed it, and it is kept.

    Raises:
        ValueError: ``folder`` is inside the installed package or is a file.
    """
    root = Path(folder).expanduser().resolve()
    if _inside_package(root):
        raise ValueError(f"{root} is inside the installed ddplab package: choose a folder of "
                         "your own, e.g. ddplab init ~/ddplab-course")
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} is a file: give ddplab init a folder (new or existing)")
    manifest_path = root / MANIFEST
    try:
        written_before = json.loads(manifest_path.read_text()).get("files", {})
    except (OSError, ValueError):
        written_before = {}
    report = InitReport(root)
    manifest = dict(written_before)
    for rel, source in shipped_files().items():
        target = root / rel
        shipped = _sha256(source)
        if not target.exists():
            bucket = report.written
        elif _sha256(target) == shipped:
            report.unchanged.append(rel)
            manifest[rel] = shipped
            continue
        elif written_before.get(rel) == _sha256(target):
            bucket = report.refreshed
        else:
            report.kept.append(rel)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        manifest[rel] = shipped
        bucket.append(rel)
    manifest_path.write_text(json.dumps({"files": manifest}, indent=1, sort_keys=True) + "\n")
    return report


def _counted(files: Sequence[str]) -> str:
    """``11 notebooks, 7 exercises`` for a list of course-relative paths."""
    folders = [rel.split("/", 1)[0] for rel in files]
    return ", ".join(f"{folders.count(name)} {name}" for name in COURSE_FILES if name in folders)


def describe(report: InitReport) -> str:
    """The words ``ddplab init`` prints: what it wrote, what it kept, how to open the course."""
    lines = [f"ddplab init: the course is in {report.folder}"]
    for verb, files in (("wrote", report.written), ("updated", report.refreshed),
                        ("already up to date:", report.unchanged)):
        if files:
            lines.append(f"  {verb} {_counted(files)}")
    if report.kept:
        lines.append(f"  kept {len(report.kept)} file(s) you changed (delete one and run "
                     f"ddplab init again to get the shipped version): {', '.join(report.kept)}")
    lines += ["Open it in JupyterLab with:", f"  ddplab lab {report.folder}",
              f"or: cd {report.folder} && jupyter lab   (then open notebooks/01_single_gpu.ipynb)"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- ddplab lab


def lab_command(folder: os.PathLike, is_root: Optional[bool] = None) -> list[str]:
    """The command ``ddplab lab`` runs: JupyterLab on 127.0.0.1, rooted at ``folder``.

    ``--allow-root`` is added when running as root (JupyterLab refuses root otherwise), as the
    Makefile's ``make lab`` does.
    """
    if is_root is None:
        is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    return [sys.executable, "-m", "jupyterlab", f"--notebook-dir={Path(folder).resolve()}",
            "--ip=127.0.0.1", *(["--allow-root"] if is_root else [])]


def lab_environment(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment ``ddplab lab`` starts JupyterLab with (default: this process's own).

    Plots inline, and ``LAB_CONFIG`` first on ``JUPYTER_CONFIG_PATH`` (the learner's own
    folders there stay, after it), as ``make lab`` does.
    """
    env = dict(os.environ if environ is None else environ)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    theirs = [p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p]
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(LAB_CONFIG), *theirs])
    return env


def lab(folder: Optional[os.PathLike] = None, extra: Sequence[str] = ()) -> int:
    """Open JupyterLab in the course folder (default: the one here, else ``./ddplab-course``).

    Returns JupyterLab's exit code. Raises ``FileNotFoundError`` when the folder holds no
    course, ``ModuleNotFoundError`` when JupyterLab is not installed (each says what to do).
    """
    if folder is None:
        folder = find_course() or Path(DEFAULT_DIR)
    root = Path(folder).expanduser().resolve()
    if not (root / "notebooks").is_dir():
        raise FileNotFoundError(f"no course in {root}: write it first with "
                                f"ddplab init {folder}")
    import importlib.util

    if importlib.util.find_spec("jupyterlab") is None:
        raise ModuleNotFoundError("JupyterLab is not installed in this Python: "
                                  "pip install 'ddplab[lab]' (or pip install jupyterlab)")
    return subprocess.call([*lab_command(root), *extra], env=lab_environment())
