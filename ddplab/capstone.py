"""The given part of the capstone: the data set, the model, the command line, and the reports.

Worker side. The learner's job (``exercises/capstone.py``) and the reference
(``ddplab/workers/capstone.py``) import these and write everything else themselves::

    args = parse_args()                    # the command line (``--help``)
    train_set, test_set = datasets(args)   # digits, or CIFAR-10 with --dataset cifar10
    model = build_model(args)              # the same initial weights on every rank
    ...
    log_step(step, loss)                   # every rank, after every optimizer step
    log_accuracy(accuracy)                 # rank 0, after the evaluation

What is watched (nothing here changes what the job computes): ``build_model`` hooks the model
it returns and ``parse_args`` hooks every optimizer's step and every module's forward (torch's
global hooks), and Python's audit hook sees the files opened under ``--checkpoint-dir``. Each
``log_step`` reports, with the learner's step number, loss and the time, what was seen since
the previous one: a fingerprint of every training sample, autocast's dtype, the LR and the
summed squares of the local gradients at the optimizer step, the sum of the optimizer's state,
the state of the ``GradScaler`` that stepped the optimizer (None without an enabled one), the
files it opened for writing under ``--checkpoint-dir``, the bytes its thread wrote (output
included), the files other than DCP's that changed in the folder (and their sizes), and the
``map_location`` of every ``torch.load`` of a file in the folder, and the dtype of the inputs
the model received (a ``MixedPrecisionPolicy`` casts them before the model's forward). As it
first reads a file of torch.distributed.checkpoint's in a folder, a rank reports that folder
and whether it held DCP's ``.metadata`` (written last: a complete checkpoint) then. At exit
every rank reports its (local) weights and the model's size in bytes.

``--kill-rank R --kill-at-step N`` kills rank R with ``SIGKILL`` in the forward pass of step N
(fault injection, here so that the learner does not write it). Rank 0 then starts the save it
begins after step N - 1 a second late, as on a busy disk, and rank R reports whether that save
was still going on when it reached step N (a job that lets a rank go past a save before the
checkpoint is whole), and whether rank 0 began that save at all (a job that saves after other
steps).

Lesson: 13.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import os
import signal
import shutil
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ddplab import data, events, models

KILL_SAVE_DELAY_S = 1.0  # rank 0's late start to the save just before the kill
SAVE_WAIT_S = 10.0  # how long the rank to kill waits for rank 0's save to begin (safety net)
SAVES = ("torch.serialization", "torch.distributed.checkpoint")  # modules whose save() counts


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the capstone's command line (see ``--help``) and start watching the run."""
    p = argparse.ArgumentParser(prog="capstone", description="The capstone's training job.")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                   help="DistributedDataParallel, or FSDP2 (fully_shard per block)")
    p.add_argument("--dataset", choices=("digits", "cifar10"), default="digits")
    p.add_argument("--data-root", default="data", help="folder of CIFAR-10 (default: data)")
    p.add_argument("--download", action="store_true", help="fetch CIFAR-10 if it is missing")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, or resnet18 for cifar10")
    p.add_argument("--width", type=int, default=8, help="channels of the cnn's first layer")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.01, help="base LR of one process (SGD)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--warmup-steps", type=int, default=10, help="linear LR warm-up")
    p.add_argument("--amp-dtype", choices=("bfloat16", "float16"), help="autocast's dtype "
                   "(default: float16 on a GPU, bfloat16 on a CPU)")
    p.add_argument("--save-every", type=int, default=8, help="optimizer steps between "
                   "checkpoints")
    p.add_argument("--checkpoint-dir", required=True, help="where the checkpoints live; one "
                   "found there is resumed")
    p.add_argument("--kill-rank", type=int, help="fault injection: the rank to kill")
    p.add_argument("--kill-at-step", type=int, help="fault injection: kill it in this step "
                   "(counted from 0 over the whole job)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads per process")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, args.save_every) < 1 or args.warmup_steps < 0:
        p.error("--epochs, --batch-size and --save-every must be at least 1, --warmup-steps "
                "at least 0")
    if (args.kill_rank is None) != (args.kill_at_step is None):
        p.error("give both --kill-rank and --kill-at-step, or neither")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.kill_rank is not None and not 0 <= args.kill_rank < world:
        p.error(f"--kill-rank {args.kill_rank}: this job has ranks 0 to {world - 1}")
    if args.strategy == "fsdp":
        from ddplab.sharded import fsdp_problem

        problem = fsdp_problem(_device())
        if problem:
            p.error(f"--strategy fsdp: {problem}")
    if args.threads:
        torch.set_num_threads(args.threads)
    _WATCH.start(args)
    events.emit("metric", name="args", value={
        k: v for k, v in vars(args).items() if k not in ("checkpoint_dir", "kill_rank",
                                                         "kill_at_step", "threads")})
    return args


def _device() -> torch.device:
    """The device this rank trains on, as the reference places it: a GPU where every process on
    this machine gets one, else the CPU (4 ranks on 1-3 GPUs run on gloo and the CPU)."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return torch.device("cuda" if cuda else "cpu")


def datasets(args: argparse.Namespace) -> tuple[Any, Any]:
    """The training set and the test set (``torch.utils.data.Dataset``s of (image, label))."""
    split = data.load_dataset(args.dataset, root=args.data_root, download=args.download,
                              as_tensors=args.dataset != "cifar10")
    return split.train, split.test


def build_model(args: argparse.Namespace) -> nn.Module:
    """A fresh model on the CPU, with the same weights on every rank and in every launch."""
    torch.manual_seed(args.seed)
    name = args.model or models.default_model(args.dataset)
    channels, classes = (1, 10) if args.dataset == "digits" else (3, 10)
    model = (models.SmallCNN(channels, classes, width=args.width) if name == "cnn" else
             models.build_model(name, classes, channels))
    _WATCH.watch(model)
    return model


def log_step(step: int, loss: Any) -> None:
    """Report optimizer step ``step`` (counted from 0 over the whole job) and this rank's loss."""
    _WATCH.log_step(int(step), float(loss))


def log_accuracy(accuracy: float) -> None:
    """Report the test accuracy (rank 0, once the training is over)."""
    events.emit("metric", name="accuracy", value=float(accuracy))


# ------------------------------------------------------------------ watching (no effect on results)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor itself)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if callable(to_local) else tensor).detach()


def _sum(tensors: Any, square: bool = False) -> float:
    total = 0.0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = _local(t).double()
            total += float((t * t).sum() if square else t.sum())
    return total


def _is_fsdp(module: nn.Module) -> bool:
    """Whether ``fully_shard`` made ``module`` a unit of its own (FSDP2, torch >= 2.6)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def _bytes_written() -> Optional[int]:
    """Bytes the calling thread has written so far (Linux's ``/proc/thread-self/io`` wchar: a
    save another thread writes, as ``async_save``'s, is not counted), None where unknown."""
    for source in ("/proc/thread-self/io", "/proc/self/io"):
        try:
            with open(source) as file:
                for line in file:
                    if line.startswith("wchar:"):
                        return int(line.split()[1])
        except OSError:
            continue
    return None


def _dcp_file(name: str) -> bool:
    """A file torch.distributed.checkpoint writes: a rank's part, or the metadata."""
    return name.endswith(".distcp") or os.path.basename(name).startswith(".metadata")


class _Watch:
    """What one rank's job did, step by step (see the module's docstring)."""

    def __init__(self) -> None:
        self.args: Optional[argparse.Namespace] = None
        self.model: Optional[nn.Module] = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.last_step: Optional[int] = None
        self.probe: Optional[torch.Tensor] = None
        self.saving: Any = None
        self.sharded_units: set[int] = set()  # modules fully_shard made units of, seen training
        self.scaler: Any = None  # the GradScaler that last stepped an optimizer
        self.folder: Optional[str] = None  # --checkpoint-dir, once started
        self.files: dict[str, tuple[int, int]] = {}  # its files: (size, mtime), as last seen
        self.read_folders: set[str] = set()  # folders whose DCP files it read (reported once)
        self.reset()

    def reset(self) -> None:
        self.samples: list[float] = []
        self.inputs: set[str] = set()  # the dtypes of the inputs the model received
        self.autocast: set[Optional[str]] = set()
        self.optimizer_steps: list[dict[str, Any]] = []
        self.written: list[str] = []
        self.loads: list[dict[str, Any]] = []
        self.wrapper_evals = self.eval_samples = 0
        self.bytes = _bytes_written()

    def start(self, args: argparse.Namespace) -> None:
        if self.args is not None:
            return
        self.args = args
        self.folder = os.path.abspath(args.checkpoint_dir)
        self.changed()  # what the folder held before this launch (a resume's) is not new
        register_optimizer_step_pre_hook(self.optimizer_step)
        register_module_forward_pre_hook(self.any_forward)
        sys.addaudithook(self.audit)
        atexit.register(self.report_weights)

    def watch(self, model: nn.Module) -> None:
        if self.model is None:  # the job's model; of a second one (to evaluate), its scoring
            self.model = model
            model.register_forward_hook(self.forward)
        else:
            model.register_forward_hook(self.scored)

    def scored(self, net: nn.Module, inputs: Any, _output: Any) -> None:
        """A forward pass of a model built to evaluate: the samples it scored."""
        if not (net.training and torch.is_grad_enabled()):
            self.eval_samples += len(inputs[0])

    def forward(self, net: nn.Module, inputs: Any, _output: Any) -> None:
        batch = inputs[0]
        if not (net.training and torch.is_grad_enabled()):
            self.eval_samples += len(batch)
            return
        if sys.getprofile() == self.late_save:
            sys.setprofile(None)  # no save between the step before the kill and this one
        args = self.args
        if args is not None and args.kill_rank == self.rank and \
                (self.last_step if self.last_step is not None else -1) + 1 == args.kill_at_step:
            self.die(args.kill_at_step, *self.rank_0_saving())
        flat = batch.detach().flatten(1).to("cpu", torch.float64)
        if self.probe is None or self.probe.numel() != flat.shape[1]:
            self.probe = torch.rand(flat.shape[1], generator=torch.Generator().manual_seed(1),
                                    dtype=torch.float64)
        self.samples += [round(float(v), 6) for v in flat @ self.probe]
        self.inputs.add(str(batch.dtype).removeprefix("torch."))
        device = batch.device.type
        self.autocast.add(str(torch.get_autocast_dtype(device)).removeprefix("torch.")
                          if torch.is_autocast_enabled(device) else None)

    def any_forward(self, module: nn.Module, _inputs: Any) -> None:
        training = module.training and torch.is_grad_enabled()
        if type(module).__name__ == "DistributedDataParallel" and not training:
            self.wrapper_evals += 1
        if training and _is_fsdp(module):
            self.sharded_units.add(id(module))

    def marker(self, name: str) -> str:
        """A file the ranks of this job share (one machine), outside the checkpoint folder."""
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "local")
        return os.path.join(tempfile.gettempdir(), f"ddplab-capstone-{run}", name)

    def rank_0_saving(self) -> tuple[bool, bool]:
        """Whether rank 0 is still inside the save it began after the step before the kill,
        and whether it began one.

        Waits for that save to begin (it began long ago when the ranks wait for it); a job
        that saves at other steps only costs this wait. Rank 0 starts that save
        ``KILL_SAVE_DELAY_S`` late, so a rank here sooner did not wait for it; a rank that did
        wait (a collective save, a barrier) may still be a moment ahead of rank 0 returning from
        it, on a busy machine: it waits for rank 0 to say so before calling the save unfinished.
        """
        began, ended = self.marker("began"), self.marker("ended")
        deadline = time.monotonic() + SAVE_WAIT_S
        while not os.path.exists(began) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            waited = time.time() - os.stat(began).st_mtime
        except OSError:
            return False, False  # no save began
        deadline = time.monotonic() + SAVE_WAIT_S
        while waited >= KILL_SAVE_DELAY_S and not os.path.exists(ended) and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        saving = not os.path.exists(ended)
        shutil.rmtree(os.path.dirname(began), ignore_errors=True)
        return saving, True

    def late_save(self, frame: Any, event: str, _arg: Any) -> None:
        """Rank 0, after the step before the kill: its save starts late (a busy disk), and the
        other ranks can see when it began and ended."""
        if frame.f_code.co_name != "save" or not str(frame.f_globals.get("__name__")).startswith(
                SAVES):
            return
        try:
            if event == "call" and self.saving is None:
                self.saving = frame
                os.makedirs(os.path.dirname(self.marker("began")), exist_ok=True)
                open(self.marker("began"), "w").close()
                time.sleep(KILL_SAVE_DELAY_S)
            elif event == "return" and frame is self.saving:
                sys.setprofile(None)
                open(self.marker("ended"), "w").close()
        except OSError:
            pass  # the rank to kill has read the markers and removed them

    def die(self, step: int, rank_0_saving: bool, rank_0_saved: bool = True) -> None:
        """The fault: this rank ends at once, with no exception and no cleanup (SIGKILL)."""
        events.emit("metric", name="fault", value={"step": step, "rank_0_saving": rank_0_saving,
                                                   "rank_0_saved": rank_0_saved})
        print(f"fault injection: killing rank {self.rank} (SIGKILL) in step {step}", flush=True)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        if all(p.grad is None or (not float(g["lr"]) and not _local(p.grad).any())
               for g in optimizer.param_groups for p in g["params"]):
            return  # torch.distributed.checkpoint initialising the state (zero grads at LR 0)
        state = [t for s in optimizer.state.values() for t in s.values()]
        frame = inspect.currentframe()
        while frame is not None:  # called from GradScaler.step? (its frame's ``self``)
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.amp.GradScaler):
                self.scaler = owner
                break
            frame = frame.f_back
        self.optimizer_steps.append({
            "lr": float(optimizer.param_groups[0]["lr"]), "grad": _sum(grads, square=True),
            "state": _sum(state)})

    def audit(self, event: str, args: tuple) -> None:
        if self.args is None or event not in ("open", "os.rename"):
            return
        target = args[1] if event == "os.rename" else args[0]
        if not isinstance(target, (str, bytes, os.PathLike)):
            return
        path = os.path.abspath(os.fsdecode(target))
        if not path.startswith(self.folder + os.sep):
            return
        if event == "open":
            mode, flags = args[1], args[2]
            writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                       else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
            if not writing:
                self.reading(path)
                self.read_from(path)
                return
        self.written.append(os.path.relpath(path, self.folder))

    def reading(self, path: str) -> None:
        """A file of the checkpoint folder opened for reading: by ``torch.load``, with which
        ``map_location``? (read from the caller's frame: the argument as it was passed)"""
        frame = inspect.currentframe()
        while frame is not None:
            if frame.f_code.co_name == "load" and frame.f_globals.get(
                    "__name__") == "torch.serialization":
                where = frame.f_locals.get("map_location")
                self.loads.append({"file": os.path.relpath(path, self.folder),
                                   "map_location": None if where is None else str(where)})
                return
            frame = frame.f_back

    def read_from(self, path: str) -> None:
        """A file of DCP's opened for reading (its ``.metadata`` first): report its folder once,
        and whether that folder held ``.metadata`` (a complete checkpoint) at the time."""
        folder = os.path.dirname(path)
        if not _dcp_file(path) or folder in self.read_folders:
            return
        self.read_folders.add(folder)
        events.emit("metric", name="read", value={
            "folder": os.path.relpath(folder, self.folder),
            "complete": os.path.exists(os.path.join(folder, ".metadata"))})

    def changed(self) -> dict[str, int]:
        """The files under the folder, DCP's aside, that appeared or changed since this rank
        last looked, with their sizes: ``torch.save`` writes from C++, which Python's audit
        hook does not see."""
        found: dict[str, int] = {}
        for top, _, names in os.walk(self.folder) if self.folder else ():
            for name in names:
                path = os.path.join(top, name)
                try:
                    stat = os.stat(path)
                except OSError:
                    continue
                rel = os.path.relpath(path, self.folder)
                if not _dcp_file(rel) and self.files.get(rel) != (stat.st_size, stat.st_mtime_ns):
                    found[rel] = stat.st_size
                self.files[rel] = (stat.st_size, stat.st_mtime_ns)
        return found

    def log_step(self, step: int, loss: float) -> None:
        before, now = self.bytes, _bytes_written()
        last = self.optimizer_steps[-1] if self.optimizer_steps else {}
        events.emit("metric", name="step", value={
            "step": step, "loss": loss, "time": time.perf_counter(), "samples": self.samples,
            "inputs": sorted(self.inputs), "autocast": sorted(self.autocast, key=str),
            "optimizer_steps": len(self.optimizer_steps), "lr": last.get("lr"),
            "grad": last.get("grad"), "state": last.get("state"), "scaler": self.scaler_state(),
            "written": self.written, "loads": self.loads, "changed": self.changed(),
            "bytes": None if before is None or now is None else now - before,
            "wrapper_evals": self.wrapper_evals, "eval_samples": self.eval_samples})
        self.last_step = step
        self.reset()
        kill = self.args.kill_at_step if self.args is not None else None
        if self.rank == 0 and kill is not None and step + 1 == kill:
            shutil.rmtree(os.path.dirname(self.marker("began")), ignore_errors=True)  # stale
            sys.setprofile(self.late_save)

    def scaler_state(self) -> Optional[dict[str, Any]]:
        """The state of the GradScaler seen stepping (its scale and growth count), after this
        step's ``update()``; None where no enabled scaler stepped an optimizer."""
        return (self.scaler.state_dict() or None) if self.scaler is not None else None

    def report_weights(self) -> None:
        """At exit: this rank's weights, parameter by parameter (its shards under FSDP)."""
        if self.model is None:
            return
        params = [p for _, p in self.model.named_parameters()]
        events.emit("metric", name="weights", value={
            "sums": [_sum([p]) for p in params], "squares": [_sum([p], True) for p in params],
            "wrapper_evals": self.wrapper_evals, "eval_samples": self.eval_samples,
            "sharded_units": len(self.sharded_units), "model_bytes": sum(
                p.numel() * p.element_size() for p in params),
            "files": sorted(os.path.relpath(os.path.join(top, name), self.folder)
                            for top, _, names in (os.walk(self.folder) if self.folder else ())
                            for name in names)})


_WATCH = _Watch()
