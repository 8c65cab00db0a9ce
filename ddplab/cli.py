"""Command line: ``python -m ddplab {doctor,init,lab,launch,check,course,bench}``.

Examples::

    python -m ddplab doctor
    python -m ddplab init [DIR]      # the notebooks and exercises into DIR (./ddplab-course)
    python -m ddplab lab [DIR]       # JupyterLab in that folder, on 127.0.0.1
    python -m ddplab launch --nproc-per-node 2 -m ddplab.workers.train --epochs 2
    python -m ddplab launch --nproc-per-node 2 my_script.py --lr 0.1
    python -m ddplab launch --engine spawn --nproc-per-node 2 my_mp_spawn_script.py
    python -m ddplab launch --json result.json ddplab/workers/train.py --epochs 2
    python -m ddplab check [DIR] [EXERCISE ...]   # judge the exercises you changed
    python -m ddplab check --submissions ROOT --jobs 2 --junit grades.xml   # grade a class
    python -m ddplab course          # execute every notebook into build/
    python -m ddplab bench           # the scaling benchmark of notebook 09

Lessons: 07 (launching from a terminal), 09 (bench), the coding exercises (check).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Optional, Sequence


def _launch(ns: argparse.Namespace) -> int:
    import os

    from .launcher.api import LaunchError, launch

    # One launch per process: preload the training stack only for ddplab's training workers.
    os.environ.setdefault("DDPLAB_PRELOAD_TRAINING", "auto")
    report = _Report(quiet=ns.quiet)
    try:
        result = launch(ns.target, ns.nproc_per_node, args=ns.args, engine=ns.engine,
                        timeout=ns.timeout, quiet=ns.quiet, backend=ns.backend,
                        nnodes=ns.nnodes, node_rank=ns.node_rank,
                        rdzv_endpoint=ns.rdzv_endpoint, master_addr=ns.master_addr,
                        master_port=ns.master_port, threads=ns.threads,
                        max_restarts=ns.max_restarts, local_rank_arg=ns.local_rank_arg or False,
                        on_event=report.event)
    except LaunchError as err:
        print(f"ddplab launch: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # Ctrl-C: every process of the job has ended
        print(f"{interrupt}" if str(interrupt) else "ddplab launch: interrupted",
              file=sys.stderr)
        if ns.json and getattr(interrupt, "result", None) is not None:
            _write_json(ns.json, interrupt.result)  # type: ignore[attr-defined]
        return 130
    if ns.json:
        _write_json(ns.json, result)
    if result.ok:
        report.finish(result)
    elif ns.quiet:
        print(f"ddplab launch: {result.status}: {result.error}", file=sys.stderr)
    return result.returncode


def _write_json(path: str, result: Any) -> None:
    with open(path, "w") as out:
        json.dump(result.to_dict(), out, indent=1, default=str)
        out.write("\n")


class _Report:
    """The terminal's view of ddplab's workers: one line per epoch, the summary in words."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.epochs: Optional[int] = None

    def event(self, event: dict[str, Any]) -> None:
        if self.quiet or event.get("rank", 0) != 0:
            return
        if event["kind"] == "progress" and event.get("epochs"):
            self.epochs = int(event["epochs"])
        elif event["kind"] == "epoch":
            self._write(epoch_line(event, self.epochs))

    def finish(self, result: Any) -> None:
        if not self.quiet and result.summary is not None:
            self._write(summary_words(result.summary))

    @staticmethod
    def _write(line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)  # above a progress bar, if one is showing
        sys.stdout.flush()


def epoch_line(event: dict[str, Any], epochs: Optional[int] = None) -> str:
    """``epoch 2/3: loss 0.4123, accuracy 91.2%, 1.84 s (732 samples/s)`` from an epoch event."""
    text = f"epoch {event.get('epoch', '?')}" + (f"/{epochs}" if epochs else "") + ":"
    parts = []
    if "loss" in event:
        parts.append(f"loss {float(event['loss']):.4f}")
    if "accuracy" in event:
        parts.append(f"accuracy {float(event['accuracy']):.1%}")
    if "epoch_time" in event:
        time_text = f"{float(event['epoch_time']):.2f} s"
        if "samples_per_s" in event:
            time_text += f" ({float(event['samples_per_s']):.0f} samples/s)"
        parts.append(time_text)
    return f"{text} {', '.join(parts)}"


def summary_words(s: dict[str, Any]) -> str:
    """The final summary of a training worker as a sentence or two."""
    words = []
    if "world_size" in s:
        where = " ".join(str(s[k]) for k in ("backend", "device") if s.get(k))
        words.append(f"trained on {s['world_size']} process(es)" + (f" ({where})" if where
                                                                     else ""))
    if "global_batch" in s:
        words.append(f"global batch {s['global_batch']}")
    if "history" in s or "epochs" in s:
        count = s.get("epochs") if isinstance(s.get("epochs"), int) else len(s["history"])
        words.append(f"{count} epoch(s)")
    text = "summary: " + ", ".join(words)
    results = []
    if "final_loss" in s:
        results.append(f"final loss {float(s['final_loss']):.4f}")
    if "final_accuracy" in s:
        results.append(f"test accuracy {float(s['final_accuracy']):.1%}")
    if s.get("samples_per_s"):
        results.append(f"{float(s['samples_per_s']):.0f} samples/s")
    if s.get("train_time"):
        results.append(f"{float(s['train_time']):.1f} s of training")
    if results:
        text += ": " + ", ".join(results)
    checksums = s.get("param_checksums_per_rank")
    if checksums:
        same = len(set(checksums)) == 1
        text += (". The weights are identical on every rank" if same else
                 ". The ranks' weights differ") + f" (checksum {float(checksums[0]):.6f})"
    return text + "."


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddplab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="report devices, backends and problems with their fixes")
    run = sub.add_parser("launch", help="run a script or module on N processes (like torchrun)")
    run.add_argument("--nproc-per-node", "--nprocs", type=int, default=2)
    run.add_argument("--engine", choices=["torchrun", "spawn"], default="torchrun")
    run.add_argument("--timeout", type=float, default=None, help="seconds (default 3600)")
    run.add_argument("--backend", choices=["gloo", "nccl", "mpi"], default=None)
    run.add_argument("--threads", type=int, default=1, help="torch threads per process")
    run.add_argument("--nnodes", type=int, default=1)
    run.add_argument("--node-rank", type=int, default=0)
    run.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 (multi-node)")
    run.add_argument("--master-addr", default=None)
    run.add_argument("--master-port", type=int, default=None)
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart every worker up to this many times after a failure "
                          "(torchrun's --max-restarts)")
    run.add_argument("--local-rank-arg", dest="local_rank_arg", action="store_const",
                     const="underscore", default=None,
                     help="pass each rank --local_rank=N before its arguments, as "
                          "torch.distributed.launch did before torch 2.0")
    run.add_argument("--local-rank-arg-dash", dest="local_rank_arg", action="store_const",
                     const="dash", help="the same with --local-rank=N (its spelling since 2.0)")
    run.add_argument("--json", metavar="PATH", default=None,
                     help="write the result (status, exit codes, root cause, summary, events, "
                          "logs) to PATH as JSON")
    run.add_argument("--quiet", action="store_true", help="print only the final error")
    run.add_argument("-m", dest="module", action="store_true",
                     help="TARGET is a module name (accepted for torchrun compatibility)")
    run.add_argument("target", help="a .py file or a module name")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    init = sub.add_parser("init", help="write the notebooks and exercises into DIR "
                                       "(keeps the files you changed)")
    init.add_argument("dir", nargs="?", default=None,
                      help="the course folder (default ./ddplab-course)")
    lab = sub.add_parser("lab", help="open JupyterLab in a course folder written by init")
    lab.add_argument("dir", nargs="?", default=None,
                     help="the course folder (default: the one here, else ./ddplab-course)")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER,
                     help="passed on to jupyter lab (e.g. --no-browser --port 8889)")
    check = sub.add_parser(
        "check", help="judge the coding exercises from a terminal (a course folder, or a "
                      "class's submissions)",
        usage="python -m ddplab check [DIR] [EXERCISE ...] [--submissions ROOT] [--jobs N] "
              "[--timeout S] [--json FILE] [--junit FILE]",
        description="Launch each exercise as its notebook does and print the judge's verdict. "
                    "Exit status 0 only when every exercise is correct.")
    check.add_argument("words", nargs="*", metavar="DIR, EXERCISE",
                       help="a course folder (default: the one here) and exercises, by key "
                            "(04) or file (sampler.py); default: every exercise file you "
                            "changed")
    check.add_argument("--submissions", metavar="ROOT", default=None,
                       help="grade each folder or .zip in ROOT, each in a fresh working copy")
    check.add_argument("--jobs", type=int, default=1,
                       help="submissions graded at once (at most one per core)")
    check.add_argument("--timeout", type=float, default=None,
                       help="seconds each launch of an exercise may take (default: the "
                            "notebook's, 60); an exercise still running after its launches' "
                            "time and a margin is killed")
    check.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    check.add_argument("--junit", metavar="FILE", default=None,
                       help="write the results as JUnit XML (one test case per exercise)")
    sub.add_parser("course", help="execute every notebook into build/ (--help for options)")
    sub.add_parser("bench", help="the scaling benchmark of 09 (--help for options)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m ddplab`` and the ``ddplab`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("course", "bench"):  # their own parsers take the options
        return int(importlib.import_module(f"ddplab.lab.{argv[0]}").main(argv[1:]) or 0)
    ns = _parser().parse_args(argv)
    if ns.command == "doctor":
        from .env import doctor

        report = doctor(full=True)
        return 1 if report["problems"] and report["gpu_count"] == 0 and not \
            report["backends"]["gloo"] else 0
    if ns.command in ("init", "lab"):
        return _workspace(ns)
    if ns.command == "check":
        return _check(ns)
    return _launch(ns)


def _workspace(ns: argparse.Namespace) -> int:
    """``ddplab init [DIR]`` and ``ddplab lab [DIR]``: write the course folder, open it."""
    from . import workspace

    try:
        if ns.command == "init":
            print(workspace.describe(workspace.init(ns.dir or workspace.DEFAULT_DIR)))
            return 0
        return workspace.lab(ns.dir, ns.jupyter_args)
    except (OSError, ValueError, ImportError) as err:
        print(f"ddplab {ns.command}: {err}", file=sys.stderr)
        return 2


def _usage(message: str) -> int:
    print(f"ddplab check: {message}", file=sys.stderr)
    return 2


def _check(ns: argparse.Namespace) -> int:
    """``ddplab check``: a learner's course folder, or a class's submissions."""
    from pathlib import Path

    from . import workspace
    from .lab import classrun, grading

    folders = [w for w in ns.words if grading.exercise_key(w) is None]
    selected = [grading.exercise_key(w) for w in ns.words if grading.exercise_key(w)]
    known = ", ".join(grading.keys())
    for word in folders:
        if not Path(word).is_dir():
            return _usage(f"{word!r} is neither an exercise ({known}, or its file name) nor "
                          "a folder")
    if len(folders) > 1 or (folders and ns.submissions):
        return _usage(f"{' and '.join(folders)}: name one course folder, then exercises"
                      + (" (with --submissions, only exercises)" if ns.submissions else ""))
    if ns.jobs < 1:
        return _usage("--jobs takes a number of submissions at once, 1 or more")
    if ns.timeout is not None and not 0 < ns.timeout < float("inf"):
        return _usage("--timeout takes a number of seconds above 0, e.g. --timeout 60")
    if not ns.submissions and ns.jobs != 1:
        return _usage("--jobs grades several submissions at once: add --submissions ROOT")
    selected = list(dict.fromkeys(selected))
    if ns.submissions:
        return _grade_class(Path(ns.submissions), selected, ns)
    course = workspace.find_course(folders[0] if folders else None)
    if course is None:
        where = folders[0] if folders else "the current folder"
        return _usage(f"no course folder in {where} (one holds notebooks/ and exercises/): "
                      "run in one, name it (ddplab check DIR), or write one with ddplab init DIR")
    if not selected:
        selected = grading.changed(course)
        if not selected:
            return _usage(f"every exercise file in {course / 'exercises'} is still the "
                          f"shipped skeleton: edit one, or name one (ddplab check 04); "
                          f"exercises: {known}")
    outcomes = grading.check_course(course, selected, ns.timeout)
    return _reports([classrun.Submission(course.name, outcomes, sum(o.seconds for o in outcomes))],
                    selected, ns)


def _grade_class(root: Any, selected: list[str], ns: argparse.Namespace) -> int:
    """``ddplab check --submissions ROOT``: a table, and the files a platform reads."""
    import os

    from .lab import classrun, grading

    if not root.is_dir():
        return _usage(f"{root} is not a folder: give the folder that holds the submissions")
    if not classrun.submissions(root):
        return _usage(f"{root} holds no submissions: give a folder with one sub-folder (or "
                      ".zip) per submission")
    if not selected:
        selected = sorted({key for path in classrun.submissions(root)
                           for key in classrun.handed_in(path)}, key=grading.keys().index)
        if not selected:
            return _usage(f"no submission in {root} changed an exercise file: name the "
                          "exercises to grade, e.g. ddplab check --submissions ROOT 04 08")
    if ns.jobs > (os.cpu_count() or 1):
        print(f"ddplab check: --jobs {ns.jobs} is more than the {os.cpu_count()} cores here: "
              f"{os.cpu_count()} at once", file=sys.stderr)
    try:   # the reports are written as each submission finishes, kept after a Ctrl-C
        results = classrun.grade_all(root, selected, ns.jobs, ns.timeout, progress=sys.stderr,
                                     on_done=lambda done: _reports(done, selected, ns))
    except KeyboardInterrupt as stop:
        done = getattr(stop, "results", [])
        print(classrun.table(done, selected))
        print(f"ddplab check: interrupted; every process it started is ended; the "
              f"{len(done)} submission(s) graded before are in the reports", file=sys.stderr)
        return 130
    print(classrun.table(results, selected))
    return _reports(results, selected, ns)


def _reports(results: list[Any], selected: list[str], ns: argparse.Namespace) -> int:
    """Write ``--json`` and ``--junit``; the exit status: 0 only when every exercise passed."""
    from .lab import classrun

    import os

    if ns.json:   # each written whole, then renamed: a kill never leaves half a file
        with open(f"{ns.json}.part", "w") as out:
            json.dump(classrun.to_json(results, selected), out, indent=1)
            out.write("\n")
        os.replace(f"{ns.json}.part", ns.json)
    if ns.junit:
        classrun.junit(results).write(f"{ns.junit}.part", encoding="utf-8", xml_declaration=True)
        os.replace(f"{ns.junit}.part", ns.junit)
    return 0 if all(r.passed == len(r.outcomes) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
