"""The course from a built wheel, outside the clone: ``ddplab init``, then from the notebooks'
folder a lesson's worker launched by module name and exercise 05 launched and judged.

The wheel is built from a copy of the sources and installed (``--no-deps``) into a fresh venv
that sees the test venv's packages through a ``.pth`` line, so nothing is downloaded. Every
command runs in a temporary folder without ``PYTHONPATH``: only the installed wheel is
importable as ``ddplab``. Nothing may be written inside the installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ddplab.workspace import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "ddplab", "notebooks",
           "exercises"]
# What notebook 05 does from a course folder, in one process (the notebooks themselves run from
# the clone): a course worker by module name, then the learner's exercise file and its judge.
LESSON = """
import ddplab
worker = ddplab.launch("ddplab.workers.barrier_demo", 2, quiet=True, timeout=300,
                       args=["--checkpoint-dir", "../work/barrier", "--delay", "0"])
exercise = ddplab.launch("../exercises/checkpoint.py", 2, quiet=True, timeout=300)
verdict = ddplab.check("05", exercise)
print(worker.ok, sorted(e["rank"] for e in worker.events_of("metric") if e["name"] == "loaded"),
      exercise.ok, bool(verdict))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 120
         ) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with the built wheel installed: (its python, the installed package, a clean env)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copyfile
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if (ROOT / name).is_dir() else {}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DDPLAB_RESULTS", "VIRTUAL_ENV")}
    env["MPLBACKEND"] = "Agg"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(tmp / "dist"), str(src)], tmp, env)
    wheel = next((tmp / "dist").glob("ddplab-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"], tmp, env).stdout.strip())
    shared = Path(sysconfig.get_paths()["purelib"]).resolve()  # torch, jupyter, nbval...
    (site / "shared-test-venv.pth").write_text(f"{shared}\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          str(wheel)], tmp, env)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return python, site / "ddplab", env, tmp


@pytest.mark.slow
def test_the_installed_wheel_runs_the_course_from_ddplab_init(installed):
    python, package, env, tmp = installed
    before = _files(package)
    assert {"_course/exercises/ddp_wrap.py", "_course/notebooks/03_ddp_spawn.ipynb",
            "lab/jupyter/labconfig/default_setting_overrides.json"} <= before
    config = _run([str(python), "-c", "from ddplab import workspace; "
                   "print(workspace.lab_environment({})['JUPYTER_CONFIG_PATH'])"], tmp, env)
    assert config.stdout.strip() == str(package / "lab" / "jupyter")  # ddplab lab's settings

    out = _run([str(python.parent / "ddplab"), "init"], tmp, env).stdout
    course = tmp / "ddplab-course"
    assert f"ddplab lab {course}" in out
    shipped = {f"{d}/{p.name}" for d in ("notebooks", "exercises")
               for p in (ROOT / d).glob(NOTEBOOK_GLOB if d == "notebooks" else "*.py")}
    assert {str(p.relative_to(course)) for p in course.glob("*/*")} == shipped

    # From the notebooks' folder: the learner's exercises, results beside the notebooks.
    probe = ("import ddplab; from ddplab.lab import judges, plots, showcode; "
             "print(ddplab.__file__); print(judges.skeleton_path('03')); "
             "print(plots.save_result('probe', {'ok': 1})); "
             "print(len(showcode.source('exercises/pipeline_forward.py', 'exercise')) > 0)")
    lines = _run([str(python), "-c", probe], course / "notebooks", env).stdout.split()
    assert lines == [str(package / "__init__.py"), str(course / "exercises" / "ddp_wrap.py"),
                     str(course / "results" / "probe.json"), "True"]

    shutil.copyfile(ROOT / "tests" / "solutions" / "checkpoint.py",
                    course / "exercises" / "checkpoint.py")  # the learner solved exercise 05
    lines = _run([str(python), "-c", LESSON], course / "notebooks", env, timeout=900).stdout
    assert lines.splitlines()[-1] == "True [0, 1] True True", lines[-5000:]
    assert _files(package) == before, "something was written inside the installed package"


def test_postmortem_reads_the_lessons_workers_also_inside_site_packages(tmp_path):
    from ddplab.lab import postmortem

    worker = tmp_path / "lib" / "python3.11" / "site-packages" / "ddplab" / "workers" / "desync.py"
    worker.parent.mkdir(parents=True)
    worker.write_text("def main():\n    dist.all_reduce(total)\n")
    lines = ["Traceback (most recent call last):",
             f'  File "{worker}", line 2, in main',
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 9, in f']
    [frame] = postmortem.user_frames(lines)     # the worker's line; torch's is library code
    assert (frame.function, frame.code) == ("main", "dist.all_reduce(total)")
