"""Why a job failed: the first genuine failure (not a peer that only lost it), and a hint where
ddplab knows the fix; torch's words read here are ``ddplab.torch_words``'s."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from . import torch_words

Logs = dict[Union[int, str], list[str]]


@dataclass
class RankFailure:
    """Why one rank (None: the launching process) failed: exit code or signal, the tail of
    its traceback, ``hint`` (what to do), ``at_exit`` (aborted once its script had run)."""

    rank: Optional[int]
    exitcode: Optional[int]
    signal: Optional[str] = None
    message: str = ""
    traceback: str = ""
    when: str = ""
    hint: str = ""
    at_exit: bool = False

    def __str__(self) -> str:
        how = f"was killed by {self.signal}" if self.signal else "ended" \
            if self.exitcode is None else f"exited with code {self.exitcode}"
        who = f"rank {self.rank}" if self.rank is not None else "the launching process"
        text = f"{who} {how}" + (f" {self.when}" if self.when else "")
        if self.message:
            text += f": {self.message}"
        if self.traceback:
            text += "\n" + self.traceback
        if self.hint:
            text += "\nhint: " + self.hint
        return text


def failures_of(codes: dict[int, Optional[int]], logs: Logs,
                otherwise: Sequence[str] = ()) -> list[RankFailure]:
    """A failure for every rank whose exit code is known and not 0, with its last error (else
    the launching process's, ``otherwise``, unless SIGTERM only ended it)."""
    found = []
    for rank, code in codes.items():
        if code not in (0, None):
            ended = signal_name(code) == "SIGTERM"
            lines = logs.get(rank) or ([] if ended else list(otherwise))
            found.append(RankFailure(rank=rank, exitcode=code, signal=signal_name(code),
                                     message=short_message(lines),
                                     traceback=traceback_tail(lines)))
    return found


#: What faulthandler (on in every rank) prints first when a signal kills the process.
_FATAL = {"Fatal Python error: " + name: sig for name, sig in (
    ("Aborted", signal.SIGABRT), ("Segmentation fault", signal.SIGSEGV),
    ("Bus error", signal.SIGBUS), ("Illegal instruction", signal.SIGILL),
    ("Floating-point exception", signal.SIGFPE))}


def fatal_signal(lines: list[str]) -> Optional[int]:
    """-N when a process's stderr ``lines`` say that signal N killed it (faulthandler's report),
    else None: its exit code where torch reported only a peer's."""
    sig = next((_FATAL[line.strip()] for line in reversed(lines) if line.strip() in _FATAL), None)
    return -int(sig) if sig is not None else None


def signal_name(code: Optional[int]) -> Optional[str]:
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def reported_exits(logs: Logs) -> dict[int, int]:
    """rank -> exit code of each failed rank that torchrun's or mp.spawn's error report names."""
    text = "\n".join(logs.get("launcher", []))
    found = {int(match["rank"]): int(match["code"])
             for match in torch_words.TORCHRUN_FAILURE.pattern.finditer(text)}
    for match in torch_words.SPAWN_FAILURE.pattern.finditer(text):
        name = match["signal"]
        found[int(match["rank"])] = -getattr(signal.Signals, name, signal.SIGKILL).value \
            if name else int(match["code"] or 1)
    return found


def echo(f: RankFailure) -> bool:
    """Whether ``f`` only lost a peer, or was ended by SIGTERM with no error of its own."""
    return bool(torch_words.PEER_LOST.search(f"{f.message}\n{f.traceback}")) \
        or (f.signal == "SIGTERM" and not f.message)


#: A rank's ``when`` where its peers only lost it and it raised nothing (see ``results``).
SILENT = ("with its exit unreported and no error of its own (os._exit, or a signal: SIGKILL "
          "from the OOM killer, say); its peers only lost it")


def explain(failures: list[RankFailure], exits: dict[int, tuple[int, float]], logs: Logs,
            stderr: Logs, said_exit: dict[int, tuple[int, float]], engine: str) -> RankFailure:
    """The root cause among ``failures``, its error read from the logs where torch gave none,
    with a hint where ddplab knows the fix (``said_exit``: the ranks' own ``exit`` events)."""
    mark_exit_aborts(failures, logs, said_exit, stderr)
    cause = root_cause(failures, exits)
    where: Union[int, str] = "launcher" if cause.rank is None else cause.rank
    if not cause.message and not cause.traceback and cause.signal is None:
        cause.message, cause.traceback = stderr_cause(stderr.get(where, [])[-50:])
    if not cause.hint:
        cause.hint = hint_for("\n".join([cause.message, cause.traceback, *stderr.get(where, []),
                                         *logs.get(where, [])[-50:],
                                         *stderr.get("launcher", [])[-50:]]), engine)
    return cause


def root_cause(failures: list[RankFailure],
                exits: dict[int, tuple[int, float]]) -> RankFailure:
    """The first genuine failure; after it a lost peer or SIGTERM, an abort at exit, then the
    launching process (mp.spawn fails when a rank did). A rank ended by SIGTERM after an error
    of its own (a collective's timeout, say, still on its way out) failed genuinely."""
    def key(f: RankFailure) -> tuple[bool, bool, bool, float, int]:
        if f.rank is None:
            return echo(f), f.at_exit, True, 0.0, -1
        return echo(f), f.at_exit, False, exits.get(f.rank, (0, 0.0))[1], f.rank
    return sorted(failures, key=key)[0]


def share_root_cause(results: list[Any], exits: dict[int, tuple[int, float]]) -> None:
    """Give every node's ``RunResult`` the first genuine failure across all nodes of the job
    (``exits``: every rank's exit code and time)."""
    causes = [r.root_cause for r in results if r.root_cause is not None]
    if not causes:
        return
    first = root_cause(causes, exits)
    for result in results:
        result.job_root_cause = first
        if len(results) > 1 and result.root_cause is not first:
            where = next(i for i, r in enumerate(results) if r.root_cause is first)
            result.error = (f"{result.error}\n" if result.error else "") + \
                f"first failure of the whole job, on node {where}: {first}"


def traceback_tail(lines: list[str], limit: int = 25) -> str:
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    return "\n".join(lines[starts[-1]:][-limit:]) if starts else ""


def short_message(lines: list[str]) -> str:
    """The exception line of the last traceback in ``lines``, or ""."""
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", line):
            return line.strip()
    return ""


EXIT_ABORT = "terminate called without an active exception"
EXIT_ABORT_HINT = (
    "an abort while the interpreter exits comes from C++ threads still running then "
    "(typically gloo's, of a process group that outlived destroy_process_group()); the work "
    "before it was done, and what the rank reported is complete. To exit cleanly, call "
    "torch.distributed.destroy_process_group() at the end and let nothing keep the group: "
    "import torch.distributed.nn before init_process_group() (its functions keep "
    "group.WORLD as a default argument when imported later, as DDP's constructor does).")


def mark_exit_aborts(failures: list[RankFailure], logs: Logs,
                     exits: dict[int, tuple[int, float]], stderr: Logs) -> None:
    """Mark a SIGABRT as ``at_exit`` when the rank said it ended cleanly, or when its stderr
    ends with ``EXIT_ABORT`` and at most a finishing process's crash report."""
    for failure in failures:
        if failure.signal != "SIGABRT":
            continue
        own = [] if failure.rank is None else stderr.get(failure.rank) or logs.get(failure.rank, [])
        said = [i for i, line in enumerate(own) if EXIT_ABORT in line]
        after = "\n".join(own[said[-1] + 1:]) if said else ""
        finishing = not after.strip() or bool(re.search(
            r"finaliz|_finish_like_an_interpreter|atexit|_exit_function", after))
        if failure.rank is not None and (exits.get(failure.rank, (None, 0.0))[0] == 0
                                         or (said and finishing)):
            failure.when = "while exiting, after its script had finished"
        elif not said and any(EXIT_ABORT in line for line in logs.get("launcher", [])):
            failure.when = "while exiting"  # mp.spawn ranks: the line does not say whose
        else:
            continue
        failure.at_exit, failure.message = True, EXIT_ABORT
        failure.traceback, failure.hint = "", EXIT_ABORT_HINT


def stderr_cause(lines: list[str]) -> tuple[str, str]:
    """(the error line, the lines before it) from the end of a process's stderr."""
    lines = [line for line in lines if line.strip()]
    tail = traceback_tail(lines)
    if tail:
        return short_message(lines) or lines[-1].strip(), tail
    return (lines[-1].strip() if lines else ""), "\n".join(lines[-10:-1])


# Failures whose fix ddplab knows: (pattern in the output, engines it applies to, what to do).
_HINTS = (
    (torch_words.TORCHRUN_VARIABLES_MISSING.pattern, ("spawn",),
     "this is a torchrun-style script: it reads RANK and WORLD_SIZE, which torchrun sets for "
     "every process it starts. Launch it with engine='torchrun' (the default; CLI: --engine "
     "torchrun). engine='spawn' is for scripts that call torch.multiprocessing.spawn "
     "themselves."),
    (torch_words.NCCL_WITHOUT_GPU.pattern, ("spawn", "torchrun"),
     "the script uses the nccl backend or CUDA devices, and this machine has no usable GPU "
     "(python -m ddplab doctor says what it has). On CPU use the gloo backend: "
     "backend = 'nccl' if torch.cuda.is_available() else 'gloo' (ddplab.dist.setup() picks it "
     "for you), keep tensors and models on the CPU, or run the script where GPUs are."),
)

NO_RANK_HINT = (
    "an mp.spawn script decides how many processes it starts; one that counts GPUs "
    "(world_size = torch.cuda.device_count(), as PyTorch's multi-GPU examples do) starts none on "
    "a machine without GPUs. Run it where GPUs are, or start as many processes as asked: ddplab "
    "offers the requested count in the DDPLAB_NPROCS environment variable "
    "(ddplab.workers.spawn_ddp reads it), and pick gloo on CPU.")


def hint_for(text: str, engine: str) -> str:
    """What to do about a failure whose output is ``text`` ("": no advice)."""
    for pattern, engines, hint in _HINTS:
        if engine in engines and pattern.search(text):
            return hint
    return ""
