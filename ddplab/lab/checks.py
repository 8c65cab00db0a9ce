"""Exercise checkers: each notebook ends with an exercise the learner answers in a cell.

``ddplab.check("03", answer)`` compares the answer with a reference computed here (never stored
in the notebook) and prints a helpful message. CI runs every checker against its own
reference answer, so a broken checker fails the build.

To add an exercise, register it below with ``@exercise(key, question)``; the decorated function
returns the reference answer, and ``compare`` (optional) returns a hint string when an answer is
wrong, or None when it is right.

Lessons: the exercise at the end of every notebook (01-09, 07b, 09b, 12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

Compare = Callable[[Any, Any], Optional[str]]


@dataclass
class Exercise:
    key: str
    question: str
    reference: Callable[[], Any]
    compare: Compare


EXERCISES: dict[str, Exercise] = {}


def equal(hint: str = "") -> Compare:
    """A comparison by ``==``."""
    def compare(answer: Any, expected: Any) -> Optional[str]:
        return None if answer == expected else (hint or f"{answer!r} is not right yet.")
    return compare


def exercise(key: str, question: str, compare: Optional[Compare] = None
             ) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Register the reference-answer function of exercise ``key``."""
    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        EXERCISES[key] = Exercise(key, question, fn, compare or equal())
        return fn
    return register


@dataclass(frozen=True)
class Verdict:
    """What ``check`` found: true when the answer is right (``assert ddplab.check(...)``).

    The message is printed by ``check``; in a notebook the verdict itself shows nothing more
    (no ``Out: False`` under an exercise not answered yet).
    """

    key: str
    correct: bool
    message: str

    def __bool__(self) -> bool:
        return self.correct

    def _ipython_display_(self) -> None:
        """Jupyter calls this instead of showing ``Out[n]``: the message is already shown."""


def check(key: str, answer: Any) -> Verdict:
    """Check a learner's answer to exercise ``key``; print why it is wrong, if it is.

    ``answer`` is either a value (the quick warm-up questions) or the ``RunResult`` of a
    launched exercise file (the coding exercises, judged by ``ddplab.lab.judges`` on what the run
    did), or a dict of named ``RunResult``s for an exercise made of several launches (13).

    Example::

        ddplab.check("02", [1, 2, 3, 4])                         # a warm-up answer: told why not
        ddplab.check("03", ddplab.launch("../exercises/ddp_wrap.py", nprocs=2))   # a run: judged
        ddplab.check("13", {"ddp": ddp, "fsdp": fsdp, "killed": killed, "resumed": resumed,
                            "resharded": resharded})

    Returns:
        A ``Verdict``, true when the answer is right.
    """
    from . import judges

    if judges.is_run_result(answer) or judges.is_run_set(answer):
        return _check_run(key, answer)
    if key not in EXERCISES:
        raise KeyError(f"no exercise {key!r}; known: {', '.join(sorted(EXERCISES))}")
    ex = EXERCISES[key]
    if answer is None or answer is Ellipsis:
        hint: Optional[str] = f"not answered yet. {ex.question}"
    else:
        hint = ex.compare(answer, ex.reference())
        hint = None if hint is None else f"not yet: {hint}"
    message = f"Question {key}: " + ("correct!" if hint is None else hint)   # (coding: Exercise)
    print(message)
    return Verdict(key, hint is None, message)


def _check_run(key: str, result: Any) -> Verdict:
    """Judge a coding exercise by what the learner's run(s) did (see ``ddplab.lab.judges``).

    A single run that failed is refused here; a set of runs goes to the judge whole (one of
    them may be meant to fail, as the capstone's killed run is).
    """
    from . import judges

    known = judges.load_all()
    if key not in known:
        raise KeyError(f"no coding exercise {key!r}; known: {', '.join(sorted(known))}")
    failed = judges.run_failed(result) if judges.is_run_result(result) else None
    hint = failed or known[key].judge(result)
    message = f"Exercise {key} ({known[key].skeleton}): " + (
        "correct!" if hint is None else f"not yet: {hint}")
    print(message)
    return Verdict(key, hint is None, message)


def reference_answer(key: str) -> Any:
    """The reference answer of exercise ``key`` (used by tests, never shown in notebooks)."""
    return EXERCISES[key].reference()


# ----------------------------------------------------------------------- exercises 01-06
# (each notebook's exercise is registered below, in notebook order)


# ------------------------------------------------------------- exercises 04-06 (lessons 04-06)


def _pair(answer: Any) -> Optional[tuple]:
    """``answer`` as a tuple of two, or None when it is not a pair."""
    try:
        items = tuple(answer)
    except TypeError:
        return None
    return items if len(items) == 2 else None


def _compare_04(answer: Any, expected: Any) -> Optional[str]:
    pair = _pair(answer)
    if pair is None:
        return "answer with a pair: (indices per rank, repeated indices per epoch)."
    try:
        per_rank, repeats = int(pair[0]), int(pair[1])
    except (TypeError, ValueError):
        return "both numbers should be integers."
    if per_rank != expected[0]:
        return ("each rank reads ceil(len(dataset) / world_size) indices: the sampler rounds "
                "up, so no rank gets fewer than another.")
    if repeats != expected[1]:
        return ("the ranks read per_rank x world_size indices in total; the dataset has only "
                "1347 different ones, so the rest are repeats.")
    return None


@exercise("04", "The digits training set has 1347 images. On 8 ranks with DistributedSampler "
          "(drop_last=False), how many indices does each rank read per epoch, and how many of "
          "all the indices read in one epoch are repeats? answer = (per_rank, repeats)",
          _compare_04)
def _exercise_04() -> tuple[int, int]:
    from .demos import sampling

    facts = sampling.padding(1347, 8)
    return facts["per_rank"], facts["repeats"]


def _compare_05(answer: Any, expected: Any) -> Optional[str]:
    try:
        epochs = [int(e) for e in answer]
    except (TypeError, ValueError):
        return "answer with a list of epoch numbers, e.g. [1, 2]."
    if epochs == expected:
        return None
    if epochs and epochs[0] < expected[0]:
        return ("the checkpoint is written after every finished epoch: the epochs it already "
                "held before the processes were killed are not trained again.")
    if epochs and epochs[0] > expected[0]:
        return ("the processes were killed before epoch 4's checkpoint replaced the file (it "
                "is written to a temporary file, then renamed): which epoch does the file hold?")
    return "the second launch trains every epoch that is not yet in the checkpoint, up to --epochs."


@exercise("05", "A job of the course's script, started with `--epochs 5 --checkpoint-dir "
          "ckpt`, saves its checkpoint after every epoch. Its processes are killed (kill -9) "
          "while rank 0 is writing the checkpoint of epoch 4; you launch the job again with "
          "`--resume`. Which epochs (numbered from 1) does the second launch train? "
          "answer = [...]", _compare_05)
def _exercise_05() -> list[int]:
    # The atomic write never replaced the file: it still holds epochs 1..3, so 4 is trained again.
    epochs, saved = 5, 3
    return list(range(saved + 1, epochs + 1))


def _dtype_name(value: Any) -> str:
    return str(value).replace("torch.", "").strip().lower()


def _compare_06(answer: Any, expected: Any) -> Optional[str]:
    try:
        given = tuple(answer)
    except TypeError:
        given = ()
    if len(given) != 3:
        return "answer with three dtypes: (a.dtype, b.dtype, out.dtype)."
    first, second, residual = (_dtype_name(v) for v in given)
    want_first, want_second, want_residual = (_dtype_name(v) for v in expected)
    if first != want_first:
        return ("autocast casts to 16 bits only the inputs of the operations on its "
                "low-precision list (section 2): is layer_norm on it, and what is x's dtype?")
    if second != want_second:
        return ("find layer_norm in the CPU's lists of autocast's op reference (CUDA's lists "
                "differ): on which list is it, if any, and what does that do with the dtype "
                "lin's output has?")
    if residual != want_residual:
        return ("`+` is on none of autocast's lists: PyTorch's type promotion decides the dtype "
                "of a sum of two tensors of different dtypes (section 2).")
    return None


@exercise("06", "Under `torch.autocast('cpu', dtype=torch.float16)`, a float32 batch `x` of 8 "
          "samples of 16 features goes through `norm, lin = nn.LayerNorm(16), nn.Linear(16, "
          "16)`: `a = norm(x)`, `b = norm(lin(a))` and `out = x + b`, all inside the block. "
          "What are the dtypes of `a`, `b` and `out`? answer = (a_dtype, b_dtype, out_dtype), "
          "e.g. (torch.bfloat16, torch.bfloat16, torch.bfloat16)", _compare_06)
def _exercise_06() -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    norm, lin = nn.LayerNorm(16), nn.Linear(16, 16)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        a = norm(x)          # layer_norm is on no CPU list: x's dtype
        b = norm(lin(a))     # linear: float16; layer_norm keeps it (on CUDA: float32)
        out = x + b          # type promotion: float32 + float16 is float32
    return a.dtype, b.dtype, out.dtype


# ------------------------------------------------------------- exercises 07-09 (lessons 07-09)


QUESTION_07_GPUS = 4   # the exercise's machines: 2 of them, 4 GPUs each, 4 processes on each
QUESTION_07_NODE = 1   # the question asks about the machine torchrun numbers 1 (GROUP_RANK 1)
#: torchrun's command line in the question (the same on both machines).
QUESTION_07_TORCHRUN = ["--nnodes", "2", "--nproc-per-node", str(QUESTION_07_GPUS),
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400", "train.py"]


def _compare_07(answer: Any, expected: Any) -> Optional[str]:
    try:
        gpus = [int(gpu) for gpu in answer]
    except (TypeError, ValueError):
        gpus = []
    if len(gpus) != QUESTION_07_GPUS:
        return "answer with a list of four device numbers: those of LOCAL_RANK 0, 1, 2 and 3."
    if gpus == expected:
        return None
    if gpus == list(range(QUESTION_07_GPUS)):
        return ("that is what the old launcher's argument gave each process. Under torchrun, "
                "where does args.local_rank come from?")
    if len(set(gpus)) == 1:
        return ("every process builds its own parser, in its own environment: is that value "
                "the same on all four processes of the machine with GROUP_RANK 1?")
    return ("each process parses its own command line: what does torchrun put on it, and what "
            "does this process's environment hold on the machine with GROUP_RANK 1?")


def question_07_parser(environ: Any) -> Any:
    """The exercise's parser, built as the script builds it in a process with ``environ``."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", type=int, default=int(environ.get("RANK", 0)))
    return parser


def question_07_environ(group_rank: int, local_rank: int) -> dict[str, str]:
    """What torchrun's agent sets for a worker of the question's job: ``RANK`` is the agent's
    base rank (the local world sizes of the agents numbered before it) plus ``LOCAL_RANK``, as
    ``_assign_worker_ranks`` in torch/distributed/elastic/agent/server/api.py computes it."""
    rank = group_rank * QUESTION_07_GPUS + local_rank
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(group_rank)}


@exercise("07", "A script reads its GPU with `parser.add_argument(\"--local-rank\", type=int, "
          "default=int(os.environ.get(\"RANK\", 0)))` and `torch.cuda.set_device("
          "args.local_rank)`. It ran on two 4-GPU machines under `python -m "
          "torch.distributed.launch --nnodes 2 --node-rank N --nproc-per-node 4 ... train.py`; "
          "now it runs unchanged under `torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend "
          "c10d --rdzv-endpoint HOST:29400 train.py` on both. What does each process of the "
          "machine with GROUP_RANK 1 pass to set_device? answer = [for LOCAL_RANK 0, 1, 2, 3]",
          _compare_07)
def _exercise_07() -> list[int]:
    """What the parser reads on each of torchrun's workers on node 1: the arguments come from
    the installed torch's own torchrun code (``config_from_args``, then the local-rank macro),
    the default from the environment torchrun's agent gives that worker."""
    from torch.distributed.elastic.utils.api import macros

    from ddplab.lab import cmdlines

    script_args = cmdlines.torchrun_config(QUESTION_07_TORCHRUN)["script_args"]
    return [question_07_parser(question_07_environ(QUESTION_07_NODE, local))
            .parse_args(macros.substitute(script_args, str(local))).local_rank
            for local in range(QUESTION_07_GPUS)]


def _compare_07b(answer: Any, expected: Any) -> Optional[str]:
    if not isinstance(answer, (list, tuple, set)) or not all(isinstance(a, str) for a in answer):
        return 'answer with a list of host names, such as ["hostX", "hostY"].'
    given, hosts = {a.strip() for a in answer}, set(QUESTION_07B_NODE_RANKS)
    if given == set(expected):
        return None
    if not given <= hosts:
        return f"the machines are {', '.join(QUESTION_07B_NODE_RANKS)}; answer with some of those."
    if not given:
        return ("`/scratch` is each machine's own disk, and `if rank == 0:` lets one process of "
                "the whole job write: can the other machines read what it wrote?")
    if given == hosts:
        return "one machine does hold the file: the one where the process with RANK 0 runs."
    if len(given) == 1:
        return ("`if rank == 0:` writes on one machine only: which machines are left without "
                "a copy?")
    return ("alpha started first and its name sorts first, but these commands name no "
            "--rdzv-backend: which rendezvous do they use, and what gives a node its GROUP_RANK "
            "there (section 2)?")


QUESTION_07B_NODE_RANKS = {"alpha": 1, "bravo": 2, "charlie": 0}   # in the order they start


def question_07b_torchrun(node_rank: int) -> list[str]:
    """The exercise's torchrun arguments on the machine started with ``--node-rank node_rank``."""
    return ["--nnodes", "3", "--nproc-per-node", "4", "--node-rank", str(node_rank),
            "--master-addr", "charlie", "--master-port", "29500", "train.py"]


@exercise("07b", "A job runs on three machines named alpha, bravo and charlie. Each starts, in "
          "that order, `torchrun --nnodes 3 --nproc-per-node 4 --node-rank N --master-addr "
          "charlie --master-port 29500 train.py` with N = 1 on alpha, 2 on bravo and 0 on "
          "charlie. train.py saves its checkpoint under `if rank == 0:` (`rank` is the global "
          "RANK) to /scratch/ckpt.pt, where /scratch is each machine's own local disk, calls "
          "`dist.barrier()`, and then every rank loads /scratch/ckpt.pt to resume. On which "
          "machines do the ranks find no file? answer = [<host names>]", _compare_07b)
def _exercise_07b() -> list[str]:
    """The machines whose node is not GROUP_RANK 0, as the installed torch's own torchrun code
    numbers them from each machine's command line (its parser and ``config_from_args``)."""
    from ddplab.lab import cmdlines

    group_rank = {}
    for host, node_rank in QUESTION_07B_NODE_RANKS.items():
        config = cmdlines.torchrun_config(question_07b_torchrun(node_rank))["config"]
        group_rank[host] = config["rdzv_configs"].get("rank")   # only a static rendezvous has it
    return sorted(host for host, rank in group_rank.items() if rank != 0)


def _compare_number(answer: Any, expected: float, mistakes: dict[float, str], ask: str,
                    fallback: str) -> Optional[str]:
    """A number within 0.1% of ``expected`` is right; a known wrong one gets its own hint."""
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return ask
    if math.isclose(value, expected, rel_tol=1e-3):
        return None
    return next((hint for wrong, hint in mistakes.items()
                 if math.isclose(value, wrong, rel_tol=1e-3)), fallback)


def _compare_08(answer: Any, expected: Any) -> Optional[str]:
    return _compare_number(answer, expected, {
        100.0: "that compares the server's link both ways with what a ring process sends one "
               "way; count the same directions on both sides.",
        101.0: "that takes a ring process's share as M; over both phases it sends "
               "2 (n - 1) / n M, and receives as much.",
        400.0: "that compares the server's one way with a ring process's both ways; count the "
               "same directions on both sides."},
        "answer with a number of processes.",
        "the server sends (n - 1) M and receives as much; a ring process sends 2 (n - 1) / n M "
        "and receives as much: write their ratio as a function of n first.")


@exercise("08", "A parameter server and a ring all-reduce the same gradient on n processes. From "
          "which n on does the server's link carry at least 100 times as many bytes as one ring "
          "process's link (both directions)? answer = <a number>", _compare_08)
def _exercise_08() -> int:
    def ratio(n: int) -> float:
        server = 2 * (n - 1)                     # in and out: (n - 1) M each way
        ring = 2 * 2 * (n - 1) / n               # in and out: 2 (n - 1) / n M each way
        return server / ring                     # n / 2
    return next(n for n in range(2, 10_000) if ratio(n) >= 100)


EPOCHS_09, EPOCH_S_09 = {1: 10, 8: 13}, {1: 14.0, 8: 2.5}   # to the target accuracy; s per epoch


def _compare_09(answer: Any, expected: Any) -> Optional[str]:
    try:
        speedup = float(answer)
    except (TypeError, ValueError):
        return "answer with one number: how many times sooner."
    if math.isclose(speedup, expected, rel_tol=0.02):
        return None
    if math.isclose(speedup, EPOCH_S_09[1] / EPOCH_S_09[8], rel_tol=0.02):
        return ("that is how much faster one epoch runs; the question asks when each job "
                "reaches the target accuracy.")
    if speedup < 1:
        return ("below 1: an efficiency, or time after / time before; the question asks how "
                "many times sooner.")
    return ("the target is an accuracy, not a number of epochs: what does each job spend to "
            "reach it?")


@exercise("09", f"A job reaches its target accuracy after {EPOCHS_09[1]} epochs on 1 GPU, at "
          f"{EPOCH_S_09[1]} s an epoch. With DDP on 8 GPUs (the same per-GPU batch, the learning "
          f"rate scaled, with warm-up) an epoch takes {EPOCH_S_09[8]} s, but the 8 times larger "
          f"global batch needs {EPOCHS_09[8]} epochs to reach the same accuracy. How many times "
          "sooner does the 8-GPU job reach the target? answer = <a number>", _compare_09)
def _exercise_09() -> float:
    return EPOCHS_09[1] * EPOCH_S_09[1] / (EPOCHS_09[8] * EPOCH_S_09[8])


LAYERS_09B, WIDTH_09B, BATCH_09B = 8, 1024, 128   # blocks of Linear(W, W) + GELU, 10-way head
EVERY_09B = 2                                      # checkpointed: blocks 1, 3, 5, 7 (every other)
RNG_STATE_09B = 5056                               # bytes of torch.get_rng_state()


def _activations_09b(checkpointed: int, rng: bool = True, loss: bool = True) -> float:
    """Bytes forward leaves for backward (float32) with ``checkpointed`` of the blocks
    checkpointed: every block's output (kept by the next block or the head), a plain block's
    GELU input too, a checkpointed block's RNG state; with parts left out."""
    tensor = BATCH_09B * WIDTH_09B * 4
    plain = LAYERS_09B - checkpointed
    return (LAYERS_09B * tensor + plain * tensor + checkpointed * (RNG_STATE_09B if rng else 0)
            + (BATCH_09B * 10 * 4 if loss else 0))


def _compare_09b(answer: Any, expected: Any) -> Optional[str]:
    try:
        got = float(answer)
    except (TypeError, ValueError):
        return "answer with one number: bytes."
    if math.isclose(got, expected, rel_tol=1e-4):
        return None
    half = LAYERS_09B // EVERY_09B
    if math.isclose(got, _activations_09b(0), rel_tol=1e-4):
        return "that is what forward keeps with no block checkpointed; half of them are here."
    if math.isclose(got, _activations_09b(LAYERS_09B), rel_tol=1e-4):
        return "that is what forward keeps with every block checkpointed; half of them run plainly."
    if math.isclose(got, _activations_09b(half, rng=False), rel_tol=1e-4):
        return ("close: a checkpointed block keeps one more thing besides its input (section 2 "
                "says what, and its size).")
    if math.isclose(got, _activations_09b(half, loss=False), rel_tol=1e-4):
        return "close: the blocks are not all that forward leaves behind; the loss keeps some too."
    if got < 1e4:
        return "answer in bytes (not MiB or MB)."
    return ("follow one tensor at a time: which tensors does each block create in forward, and "
            "is anything still holding each of them when forward ends?")


@exercise("09b", f"An MLP like section 2's, {LAYERS_09B} blocks of Linear({WIDTH_09B}, "
          f"{WIDTH_09B}) + GELU and a 10-way head, trains in float32 at a batch of {BATCH_09B}, "
          "with activation checkpointing on every other block only (the 1st, 3rd, 5th and 7th; "
          "the others run plainly). How many bytes does forward leave allocated for backward? "
          "answer = <a number of bytes>", _compare_09b)
def _exercise_09b() -> float:
    return _activations_09b(LAYERS_09B // EVERY_09B)


# ------------------------------------------------------------- exercises 01-03 (lessons 01-03)

EPOCH_TIMES_01 = [2.6, 1.0, 1.6, 0.9, 1.25, 1.1]  # seconds, synchronized; the first: warm-up
SAMPLES_01, BATCH_01, STEPS_01 = 1000, 64, 16      # the last batch has 40 samples, not 64
STEP_MS_01 = 21                                    # a step clock read without synchronize()


def _compare_01(answer: Any, expected: Any) -> Optional[str]:
    import statistics

    try:
        rate = float(answer)
    except (TypeError, ValueError):
        return "answer with one number: samples per second."
    if math.isclose(rate, expected, rel_tol=1e-3):
        return None
    timed, every = EPOCH_TIMES_01[1:], EPOCH_TIMES_01
    close = lambda *values: any(math.isclose(rate, v, rel_tol=1e-3) for v in values)
    if close(*(n / (STEP_MS_01 / 1e3) for n in (BATCH_01, SAMPLES_01 / STEPS_01)),
             SAMPLES_01 / (STEPS_01 * STEP_MS_01 / 1e3)):
        return ("that uses the step clock: read without synchronize(), what does it measure on "
                "a GPU (rule 1)?")
    if close(*(STEPS_01 * BATCH_01 / t for t in (statistics.median(timed),
                                                  statistics.mean(timed)))):
        return "count the samples an epoch trains on: are all of its 16 batches full?"
    if close(SAMPLES_01 / statistics.mean(timed)):
        return "that uses the mean; the median is not thrown off by one slow epoch (rule 3)."
    if close(SAMPLES_01 / statistics.median(every), SAMPLES_01 / statistics.mean(every)):
        return "leave the first epoch out: it includes the warm-up, not the steady speed."
    return ("which of the numbers measure steady training, and which single epoch time stands "
            "for the timed ones (rules 1 to 3)?")


@exercise("01", f"A run trains on a GPU on {SAMPLES_01} samples, {STEPS_01} steps an epoch at "
          f"batch {BATCH_01}. Its epochs took {EPOCH_TIMES_01} seconds, each timed between two "
          "torch.cuda.synchronize() calls, the first one being the warm-up; a step clock read "
          f"without synchronize() shows a median of {STEP_MS_01} ms a step. What throughput do "
          "you report, in samples/s? answer = <a number>", _compare_01)
def _exercise_01() -> float:
    import statistics

    return SAMPLES_01 / statistics.median(EPOCH_TIMES_01[1:])


def _compare_02(answer: Any, expected: Any) -> Optional[str]:
    if not callable(answer):
        return ("answer with your function: answer = idle_gpus, where idle_gpus(batch, gpus) "
                "returns a count of GPUs.")
    if _code_names(answer) & {"chunk", "scatter_sizes", "tensor_split", "split"}:
        return ("write the rule in arithmetic (//, %, math.ceil): chunk and scatter_sizes are "
                "what it should predict, not the way to compute it.")
    from .demos import dataparallel

    misses = []
    for batch, gpus in _GRID_02:
        try:
            got = answer(batch, gpus)
        except Exception as exc:  # the learner's code: any error is a hint, not a crash
            return (f"idle_gpus({batch}, {gpus}) raised {type(exc).__name__}; it should return "
                    "a count for every batch >= 1 and gpus >= 1.")
        if got is None:
            return "idle_gpus returned None: return the number of GPUs that get no samples."
        if got != gpus - len(dataparallel.scatter_sizes(batch, gpus)):
            misses.append((batch, gpus, got))
    if not misses:
        return None
    if any(batch % gpus == 0 for batch, gpus, _ in misses):
        return ("a batch that divides by the GPU count gives every GPU a chunk of the same "
                "size: none idles.")
    if all(batch > gpus for batch, gpus, _ in misses):
        return ("a batch larger than the GPU count can leave GPUs idle too: chunks of "
                "ceil(batch / gpus) samples can run out before the last GPU.")
    batch, gpus, got = misses[0]
    return (f"for a batch of {batch} on {gpus} GPUs your rule says {got!r}; "
            f"scatter_sizes({batch}, {gpus}) shows the chunks.")


_GRID_02 = [(batch, gpus) for gpus in range(1, 17) for batch in range(1, 65)]


def _code_names(fn: Any) -> set[str]:
    """Every global and attribute name a function's code (nested code too) refers to."""
    names: set[str] = set()
    todo = [getattr(fn, "__code__", None)]
    while todo:
        code = todo.pop()
        if code is not None:
            names |= set(code.co_names)
            todo += [c for c in code.co_consts if hasattr(c, "co_names")]
    return names


@exercise("02", "nn.DataParallel scatters a batch of `batch` samples over `gpus` GPUs. Derive "
          "from the chunk size a function idle_gpus(batch, gpus) that returns how many GPUs "
          "get no samples, in arithmetic (not chunk or scatter_sizes); the check tries every "
          "batch from 1 to 64 on 1 to 16 GPUs. answer = idle_gpus",
          _compare_02)
def _exercise_02() -> Callable[[int, int], int]:
    def idle_gpus(batch: int, gpus: int) -> int:
        per_gpu = -(-batch // gpus)            # ceil(batch / gpus) samples in a full chunk
        return gpus - -(-batch // per_gpu)     # the GPUs after the last chunk

    return idle_gpus


def _compare_03(answer: Any, expected: Any) -> Optional[str]:
    pair = _pair(answer)
    if pair is None:
        return "answer with a pair: (global batch, learning rate)."
    try:
        batch, lr = int(pair[0]), float(pair[1])
    except (TypeError, ValueError):
        return "the global batch is a whole number and the learning rate a number."
    if batch != expected[0]:
        return ("the global batch is every sample that goes into one optimizer step: count the "
                "processes, and the micro-batches each one accumulates before it steps.")
    if math.isclose(lr, 0.02 * 4 * 3, rel_tol=1e-6):
        return ("that multiplies by world size x micro-batches, as the worker's --scale-lr does "
                "when the per-process batch is the one the learning rate was tuned with; here "
                "it is not: the rule compares the new global batch with the tuned batch.")
    if not math.isclose(lr, expected[1], rel_tol=1e-6):
        return ("the linear scaling rule multiplies the learning rate by the same factor as "
                "the batch grew, from the batch the learning rate was tuned with.")
    return None


@exercise("03", "A job was tuned on one GPU with SGD at lr 0.02 and batch_size=32. It moves to "
          "DDP on 4 GPUs with batch_size=16 in every process, and every rank accumulates 3 "
          "micro-batches per optimizer step. What is the global batch of one step, and which "
          "learning rate does the linear scaling rule give? answer = (global_batch, lr)",
          _compare_03)
def _exercise_03() -> tuple[int, float]:
    tuned_batch, tuned_lr = 32, 0.02
    per_process, world_size, micro_batches = 16, 4, 3
    global_batch = per_process * world_size * micro_batches
    return global_batch, tuned_lr * global_batch / tuned_batch


# ------------------------------------------------------------------ exercise 12 (lesson 12)

def _compare_12(answer: Any, expected: Any) -> Optional[str]:
    try:
        counts = tuple(int(n) for n in answer)
    except (TypeError, ValueError):
        counts = ()
    if len(counts) != 4:
        return ("answer with four whole numbers: (forward all-gathers, forward reduce-scatters, "
                "backward all-gathers, backward reduce-scatters).")
    if counts == expected:
        return None
    if counts == (1, 1, 1, 1):
        return ("that is the LayerNorm + MLP block's count, where one layer reads the input; "
                "here each layer that reads it has its own style, with its own input layout.")
    if counts[2:] == (0, 0):
        return "backward communicates too: each rank needs the gradient of its own tokens."
    if counts[2:] == counts[:2]:
        return ("backward does not repeat the forward's collectives: what does the gradient of "
                "an all-gather, and of a reduce-scatter, take? (section 6)")
    return ("count per layer: which of q, k, v and out gathers the sequence or scatters it in "
            "forward, and what each of those becomes in backward.")


@exercise("12", "Section 3's attention under sequence parallel: its input is this rank's slice "
          "of the sequence (Shard(1)); q, k and v each get ColwiseParallel(input_layouts=Shard(1))"
          " and out gets RowwiseParallel(output_layouts=Shard(1)). How many all-gathers and "
          "reduce-scatters do one forward and one backward run? answer = (forward all-gathers, "
          "forward reduce-scatters, backward all-gathers, backward reduce-scatters)", _compare_12)
def _exercise_12() -> tuple[int, int, int, int]:
    gathering, scattering = 3, 1      # q, k, v each gather their input; out scatters its output
    # backward: each all-gather's gradient is reduce-scattered, each reduce-scatter's gathered
    return gathering, scattering, scattering, gathering
