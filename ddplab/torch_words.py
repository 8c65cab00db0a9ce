"""Torch's and Python's words: the one place where ddplab reads another program's message text.

ddplab recognises a fault by its exception type, a process's exit code or signal, or the data a
rank reported, wherever it can. Some faults say what they are only in words: nccl asked for on a
machine without GPUs, a gloo collective that timed out, the collective fingerprints of a
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` mismatch, DDP's list of parameters that received no
gradient. Every such pattern lives here, and nowhere else (``tests/test_no_torch_wording.py``
keeps it so): when a torch release changes its words, this file is the one to mend.

Each ``Words`` names the fault it recognises and, in ``seen``, the lines it was written from,
with the torch releases they were seen on (a different wording per release where they differ).
``tests/test_torch_words.py`` checks every pattern against its ``seen`` lines and against the
real fault on the installed torch; ``make test-compat`` runs it on the floor and the newest.

Stdlib only, imports no ddplab module: both sides use it (the launcher, the post-mortem helpers
and the judges on the kernel side; the tests everywhere).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Words:
    """A fault recognised by its wording: what it means, the pattern, and where it was seen.

    ``seen``: (releases, a line seen there) pairs; the pattern matches every one. The lines of
    torch 2.14.1 and Python 3.11 were read from the real faults; the others come from reports
    and from earlier versions of ddplab's own patterns.
    """

    name: str
    fault: str
    pattern: re.Pattern
    seen: tuple[tuple[str, str], ...]

    def search(self, text: str) -> Optional[re.Match]:
        return self.pattern.search(text)

    def lines(self, lines: list[str]) -> list[str]:
        """The lines that say it."""
        return [line for line in lines if self.pattern.search(line)]


#: A healthy rank's error when a peer died first: never the root cause of a failed job.
PEER_LOST = Words(
    "peer lost", "this rank lost a peer (or was stopped) after another rank failed",
    re.compile(r"Connection closed by peer|Connection reset by peer|ECONNRESET|Broken pipe|"
               r"SignalException|Socket Timeout|terminated by the launcher", re.IGNORECASE),
    (("2.6-2.14", "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
                  "Connection closed by peer [127.0.0.1]:32142. This is typically caused by a "
                  "remote worker crashing."),
     ("2.6-2.14", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read "
                  "error [127.0.0.1]:28805: Connection reset by peer."),
     ("2.6-2.14", "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 "
                  "got signal: 15"),
     ("2.6-2.14", "torch.distributed.DistNetworkError: Socket Timeout"),
     ("2.6-2.14", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Broken "
                  "pipe")),
)

#: nccl (or CUDA) asked for where there is no usable GPU. Known lines, and the fault's class
#: for wordings to come: an error line that names nccl beside a GPU, CUDA or device.
NCCL_WITHOUT_GPU = Words(
    "nccl without a GPU", "the nccl backend or a CUDA device was asked for without a GPU",
    re.compile(r"ProcessGroupNCCL is only supported with GPUs|no GPUs found|"
               r"Found no NVIDIA driver|No CUDA GPUs are available|"
               r"Torch not compiled with CUDA enabled|CUDA driver initialization failed|"
               r"invalid device ordinal|NCCL is not available|NCCL error|"
               r"(?i:\bnccl\w*\b.*\b(gpus?|cuda|devices?)\b|\b(gpus?|cuda)\b.*\bnccl)"),
    (("2.6-2.14", "ValueError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!"),
     ("2.15", "RuntimeError: nccl2 requires at least one CUDA device"),
     ("2.6-2.14", "RuntimeError: Found no NVIDIA driver on your system."),
     ("2.6-2.14", "AssertionError: Torch not compiled with CUDA enabled"),
     ("2.6-2.14", "RuntimeError: Distributed package doesn't have NCCL built in; "
                  "NCCL is not available")),
)

#: A torchrun-style script run without torchrun: the variables torchrun sets are missing.
TORCHRUN_VARIABLES_MISSING = Words(
    "torchrun's variables missing", "RANK, WORLD_SIZE or LOCAL_RANK is not set",
    re.compile(r"environment variable (RANK|WORLD_SIZE|LOCAL_RANK) expected, but not set|"
               r"KeyError: '(RANK|WORLD_SIZE|LOCAL_RANK)'"),
    (("2.6-2.14", "ValueError: Error initializing torch.distributed using env:// rendezvous: "
                  "environment variable RANK expected, but not set"),
     ("Python 3.11", "KeyError: 'LOCAL_RANK'")),
)

#: A gloo collective (or point-to-point operation) that waited longer than the process
#: group's timeout for its peers.
COLLECTIVE_TIMEOUT = Words(
    "collective timed out", "a collective waited longer than the process group's timeout",
    re.compile(r"Timed out waiting \d+ ?ms for (send|recv) operation|"
               r"Timed out waiting \d+ ?ms|\btimed out\b.*\b(collective|operation|gloo)\b",
               re.IGNORECASE),
    (("2.6-2.14", "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/"
                  "unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to "
                  "complete"),
     ("2.6-2.14", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                  "Timed out waiting 3000ms for recv operation to complete")),
)

#: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s report that the ranks called different collectives.
DETAIL_MISMATCH = Words(
    "collectives out of step (DETAIL)", "the ranks called different collectives or shapes",
    re.compile(r"Detected mismatch between collectives on ranks"),
    (("2.6-2.14", "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is "
                  "running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST, "
                  "TensorShape=[1], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype="
                  "float (default), device=cpu)), but Rank 1 is running collective: "
                  "CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[2], "
                  "TensorDtypes=Double, TensorDeviceTypes=TensorOptions(dtype=float (default), "
                  "device=cpu)).Collectives differ in the following aspects: "),
     ("2.6-2.14", "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is "
                  "running collective: CollectiveFingerPrint(SequenceNumber=0OpType=BARRIER), "
                  "but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0"
                  "OpType=GATHER).Collectives differ")),
)

# One rank's fingerprint in a DETAIL mismatch, and its fields (2.6-2.14: "Rank 1 is running
# collective: CollectiveFingerPrint(SequenceNumber=1, OpType=ALLGATHER, TensorShape=[50],
# TensorDtypes=Long, ...)" followed by ", but" or ".Collectives"; a barrier's has no comma).
FINGERPRINT = re.compile(
    r"Rank (?P<rank>\d+) is running collective: CollectiveFingerPrint\((?P<body>.*?)\)"
    r"(?:, but|\.Collectives)")
FINGERPRINT_FIELDS = {"op": re.compile(r"OpType=(\w+)"),
                      "shape": re.compile(r"TensorShape=(\[[^\]]*\])"),
                      "dtype": re.compile(r"TensorDtypes=(\w+)")}


def fingerprints(message: str) -> dict[int, dict[str, str]]:
    """Each rank's collective in a DETAIL mismatch: ``{rank: {"op":, "shape":, "dtype":}}``.

    Fields the fingerprint does not have (a barrier has no tensor) are left out.
    """
    found: dict[int, dict[str, str]] = {}
    for match in FINGERPRINT.finditer(message):
        fields = {key: hit.group(1) for key, pattern in FINGERPRINT_FIELDS.items()
                  if (hit := pattern.search(match["body"])) is not None}
        found[int(match["rank"])] = fields
    return found


#: DDP's report, under ``TORCH_DISTRIBUTED_DEBUG=INFO`` (or DETAIL), of the parameters that
#: received no gradient in the step before ("Expected to have finished reduction ...").
UNUSED_PARAMETERS = Words(
    "unused parameters (DDP)", "parameters that received no gradient, by rank",
    re.compile(r"Parameters which did not receive grad for rank (?P<rank>\d+): "
               r"(?P<names>[\w.]+(?:, [\w.]+)*)"),
    (("2.6-2.14", "Parameters which did not receive grad for rank 0: aux.bias, aux.weight"),),
)


def unused_parameters(lines: list[str]) -> dict[int, set[str]]:
    """``{rank: names of its parameters that received no gradient}`` from DDP's report."""
    found: dict[int, set[str]] = {}
    for line in lines:
        for match in UNUSED_PARAMETERS.pattern.finditer(line):
            found.setdefault(int(match["rank"]), set()).update(match["names"].split(", "))
    return found


#: DDP's warning that ``find_unused_parameters=True`` found nothing to find (and costs a walk
#: of the autograd graph every step). Printed by C++ on stderr, not a Python warning.
FIND_UNUSED_COST = Words(
    "find_unused_parameters without unused parameters",
    "find_unused_parameters=True was given, but every parameter was used",
    re.compile(r"find_unused_parameters=True was specified.*did not find any unused"),
    (("2.6-2.14", "[rank0]:[W1125 23:01:35.416792267 reducer.cpp:1529] Warning: "
                  "find_unused_parameters=True was specified in DDP constructor, but did not "
                  "find any unused parameters in the forward pass. This flag results in an "
                  "extra traversal of the autograd graph every iteration"),),
)

#: Python's unpickling error in a process that receives a function by name from a ``__main__``
#: it cannot import (``mp.spawn`` of a function defined in a notebook cell). The type,
#: AttributeError, is what ddplab relies on; the words only show which line it is.
UNPICKLABLE_MAIN = Words(
    "function from __main__", "a child could not import a function defined in __main__",
    re.compile(r"Can't get attribute '\w+' on <module '__main__'"),
    (("Python 3.11", "AttributeError: Can't get attribute 'hello' on <module '__main__' "
                          "(built-in)>"),),
)

#: argparse's refusal of an option the script does not define (a script written for
#: torchrun given ``--local-rank`` by torch.distributed.launch, lesson 07).
UNRECOGNIZED_ARGUMENTS = Words(
    "unrecognized arguments", "a script's argparse refused an option it does not define",
    re.compile(r"error: unrecognized arguments: (?P<arguments>.*)"),
    (("Python 3.11", "train.py: error: unrecognized arguments: --local-rank=1"),),
)

#: torchrun's error report (its ``ChildFailedError``), a failed rank and its exit code
#: (-N: killed by signal N); the launcher reads the ranks of a torchrun subprocess from it.
TORCHRUN_FAILURE = Words(
    "torchrun's failure report", "torchrun reports a rank that failed, with its exit code",
    re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+).*\n\s*exitcode\s*:\s*(?P<code>-?\d+)", re.M),
    (("2.6-2.14", "  rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: 4242)"),),
)

#: ``mp.spawn``'s error for a failed process: its exit code, its signal, or its exception.
SPAWN_FAILURE = Words(
    "mp.spawn's failure report", "torch.multiprocessing.spawn reports a process that failed",
    re.compile(r"[Pp]rocess (?P<rank>\d+) terminated with (?:exit code (?P<code>\d+)|signal "
               r"(?P<signal>SIG\w+)|the following error)"),
    (("2.6-2.14", "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated "
                  "with exit code 3"),
     ("2.6-2.14", "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated "
                  "with signal SIGKILL"),
     ("2.6-2.14", "-- Process 1 terminated with the following error:")),
)

#: Every pattern of this module (the tests walk it).
ALL = (PEER_LOST, NCCL_WITHOUT_GPU, TORCHRUN_VARIABLES_MISSING, COLLECTIVE_TIMEOUT,
       DETAIL_MISMATCH, UNUSED_PARAMETERS, FIND_UNUSED_COST, UNPICKLABLE_MAIN,
       UNRECOGNIZED_ARGUMENTS, TORCHRUN_FAILURE, SPAWN_FAILURE)
