"""A rank's first frame (forked by the agent, or ``__main__`` in a torchrun subprocess): output to
the caller's socket, every thread's stack at SIGUSR1 (a timeout names each rank's line), the
target run as ``python`` would, and how it ended said (an ``exit`` event)."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import json
import os
import signal
import sys
import time
import traceback
import zipfile
from typing import Any, Callable

from ..env import set_parent_death_signal
from ..events import MARKER
from ..flight_recorder import start_in_rank
from .procs import connect_streams

#: ``local_rank_arg`` values: the option ``torch.distributed.launch`` passed before torch 2.0
#: (``--local_rank=N``) and since (``--local-rank=N``).
LOCAL_RANK_OPTIONS = {"underscore": "--local_rank", "dash": "--local-rank"}
STACK_SIGNAL = signal.SIGUSR1


_EXIT_HANDLERS: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []


def run_target(target: str, args: list[str]) -> None:
    """Run a script (file, directory or zip) or a module, as a fresh ``python`` would."""
    import runpy

    for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    for option in os.environ.get("PYTHONWARNINGS", "").split(","):
        if option.strip() and option not in sys.warnoptions:  # (a fresh python applied it)
            _warning_filter(option)
    start_in_rank()  # launch(flight_recorder=True): torch's debug server, on the job's path
    option = LOCAL_RANK_OPTIONS.get(os.environ.get("DDPLAB_LOCAL_RANK_ARG", ""))
    sys.argv = [target, *([f"{option}={os.environ['LOCAL_RANK']}"] if option else []), *args]
    if os.path.isabs(target):
        if os.path.isfile(target) and not zipfile.is_zipfile(target):
            sys.path.insert(0, os.path.dirname(target))  # (run_path adds a directory or zip)
        runpy.run_path(target, run_name="__main__")
    else:
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def _warning_filter(option: str) -> None:
    """Apply one ``PYTHONWARNINGS`` option (``action:message:category:module:lineno``) as
    Python does."""
    import importlib
    import re
    import warnings

    action, message, category, module, lineno = ([p.strip() for p in option.split(":")]
                                                  + [""] * 5)[:5]
    try:
        action = next(a for a in ("default", "always", "ignore", "module", "once", "error")
                      if a.startswith(action or "default"))
        where, _, name = category.rpartition(".")
        kind = getattr(importlib.import_module(where or "builtins"), name) if name else Warning
        warnings.filterwarnings(action, re.escape(message), kind,
                                re.escape(module) + r"\Z" if module else "", int(lineno or 0))
    except (StopIteration, AttributeError, ImportError, ValueError, TypeError) as exc:
        print(f"ddplab: invalid PYTHONWARNINGS option ignored: {option!r} ({exc})",
              file=sys.stderr)


def run_rank(target: str, args: list[str], threads: int = 0) -> None:
    """One rank (forked when ``threads`` is given); it ends as ``python script.py`` would
    (``sys.exit(-1)`` is 255, an uncaught ``KeyboardInterrupt`` death by SIGINT)."""
    set_parent_death_signal()  # (torchrun starts each rank in a session of its own)
    if os.getppid() == 1:  # its parent died before the line above
        sys.exit(1)
    pipe = _announce()
    if threads:
        _like_a_fresh_process(threads)
    code, interrupted = 0, False
    try:
        run_target(target, args)
    except KeyboardInterrupt as exc:  # python then ends the process by SIGINT
        code, interrupted = -int(signal.SIGINT), True
        _print_user_traceback(exc)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001  (as python does: print it, exit 1)
        code = 1
        _print_user_traceback(exc)
    if threads:
        _finish_like_an_interpreter()
    _say_exit(code, pipe)
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code:  # (a forked rank that returns is a success to the agent)
        sys.exit(code & 0xFF)


def _announce() -> tuple[int, int]:
    """Output to the caller's socket, the stack on SIGUSR1 and a fatal signal; what fd 1 is."""
    connect_streams(f"rank {os.environ['RANK']}")
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    stat = os.fstat(1)
    return stat.st_dev, stat.st_ino


def _like_a_fresh_process(threads: int) -> None:
    """Undo what the agent set up in this process, as if it had started afresh."""
    import logging
    import multiprocessing

    logging.disable(logging.NOTSET)
    # The agent's handlers (inherited through fork) would turn SIGTERM, SIGHUP and SIGQUIT
    # into an exception.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # multiprocessing fixed this process's start method when it forked it: a script's own
    # set_start_method("spawn") would raise "context has already been set".
    multiprocessing.set_start_method(None, force=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # A fresh process seeds torch's and numpy's generators from the OS; a fork copies the
    # helper's, the same in every rank of every launch (Python's random reseeds itself).
    torch.default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if torch.cuda._is_in_bad_fork():  # the CPU-visible probe: no CUDA call is made
        print("ddplab: warning: this worker was forked after its launcher touched CUDA, so it "
              "cannot use the GPU. Relaunch with DDPLAB_LAUNCH_PATH=subprocess and report "
              "this with your torch version.", file=sys.stderr, flush=True)
    # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported: in the
    # helper, before this job's environment was set. Read it again, as a fresh process would.
    if torch.distributed.is_available() and hasattr(torch.distributed, "set_debug_level_from_env"):
        torch.distributed.set_debug_level_from_env()
    # The helper's own exit handlers are not this script's: keep a list of the script's, which
    # run when it ends (a forked rank leaves through os._exit, which runs none).
    register = atexit.register

    def recorded(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        _EXIT_HANDLERS.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recorded  # (the standard library's module, in this rank only)


def _finish_like_an_interpreter() -> None:
    """Flush, run exit handlers and collect cycles, as ``python`` does on its way out."""
    _flush()
    while _EXIT_HANDLERS:
        func, args, kwargs = _EXIT_HANDLERS.pop()
        atexit.unregister(func)
        try:
            func(*args, **kwargs)
        except Exception:  # noqa: BLE001  (as the interpreter does: print it, go on)
            traceback.print_exc()
    gc.collect()
    _flush()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a script may close its own stdout
            stream.flush()


def _say_exit(code: int, pipe: tuple[int, int]) -> None:
    """Tell the caller how the script ended, if fd 1 is still ``pipe`` (a script may close
    its stdout, and fd 1 then name another file)."""
    event = {"kind": "exit", "rank": int(os.environ["RANK"]), "code": code, "time": time.time()}
    with contextlib.suppress(OSError):
        stat = os.fstat(1)
        if (stat.st_dev, stat.st_ino) == pipe:
            _flush()
            os.write(1, (MARKER + json.dumps(event) + "\n").encode())


def _print_user_traceback(exc: BaseException) -> None:
    """Print the traceback without the launcher's frames."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


if __name__ == "__main__":  # ``python -m ddplab.launcher.entry TARGET [ARGS...]``: torchrun's
    run_rank(sys.argv[1], sys.argv[2:])
