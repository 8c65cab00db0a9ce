"""The fixed part of the capstone: one DDP run that calls the learner's nine functions.

Worker side. ``exercises/capstone.py`` (the learner's) and ``ddplab/workers/capstone.py`` (the
reference) both end with ``ddplab.capstone.run(sys.modules[__name__])``. The run, top to bottom:

1. setup (a process group even for one rank, so the same functions run at every world size);
2. data (digits, or CIFAR-10 with ``--dataset cifar10``) and ``make_loader``;
3. the model, seeded alike on every rank, ``wrap_model``, ``mixed_precision``, SGD;
4. ``resume`` from ``<checkpoint-dir>/checkpoint.pt`` when the file exists (a restarted job);
5. per epoch: ``train_epoch``, ``save_checkpoint``, ``evaluate``; ``--kill-rank R
   --kill-epoch E`` kills rank R with SIGKILL halfway through epoch E (fault injection).

While it runs it watches, without changing what the functions compute, and reports ``metric``
events the judge (``ddplab.lab.judges.capstone``) reads: which samples every rank read per epoch
(a hash of the labels in order), the LR of every optimizer step, whether the forward passes
ran under autocast and in which dtype, who wrote the checkpoint (Python's audit hook sees
opens and renames; ``/proc/self/io`` counts the bytes a rank wrote), whether it was renamed
into place, which epoch every rank found on disk when ``save_checkpoint`` returned, where
``read_checkpoint`` puts tensors (asked for the ``meta`` device too) and whether it refuses a
pickled object, and what ``evaluate`` ran and returned. Rank 0 also emits an ``epoch`` event
per epoch (for the live plot) and a ``summary`` at the end (``train.summarize``).

Rank 0 starts its first save half a second late, as a big model on a busy disk would: a rank
that returns from ``save_checkpoint`` without waiting then finds no file, on any machine.

Lesson: 13.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.utils.data import TensorDataset

from ddplab import data, dist, events, models, pinning, train

FIRST_SAVE_DELAY_S = 0.5  # rank 0's late start to its first save
CHECKPOINT = "checkpoint.pt"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the capstone's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="capstone", description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=("digits", "cifar10"), default="digits")
    p.add_argument("--data-root", default="data", help="folder of CIFAR-10 (default: data)")
    p.add_argument("--download", action="store_true", help="fetch CIFAR-10 if it is missing")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, or resnet18 for cifar10")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.02, help="base LR of one process (SGD)")
    p.add_argument("--warmup-epochs", type=float, default=1.0, help="linear LR warm-up")
    p.add_argument("--checkpoint-dir", help="where checkpoint.pt lives; an existing one is "
                   "resumed (default: a new folder per launch, removed at the end)")
    p.add_argument("--kill-rank", type=int, help="fault injection: the rank to kill")
    p.add_argument("--kill-epoch", type=int, default=2, help="kill it halfway through this "
                   "epoch (from 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads per process")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be at least 1")
    if args.kill_rank is not None and not 1 <= args.kill_epoch <= args.epochs:
        p.error(f"--kill-epoch must be between 1 and --epochs ({args.epochs})")
    return args


# ------------------------------------------------------------------ watching (no effect on results)


class Recorder:
    """The learner's loader, unchanged, plus a record of which samples came out, in order."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.reset()

    def reset(self) -> None:
        self.labels: list[torch.Tensor] = []  # kept where they are: no GPU sync per batch
        self.samples = 0

    def __iter__(self):
        for batch in self.loader:
            self.labels.append(batch[1].detach())
            self.samples += len(batch[1])
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # loader.sampler, loader.set_epoch, ...
        return getattr(self.loader, name)

    def order(self) -> str:
        """A fingerprint of this epoch's samples in their order (a hash of the labels)."""
        labels = torch.cat(self.labels).cpu().to(torch.int64) if self.labels else torch.zeros(0)
        return hashlib.sha1(labels.numpy().tobytes()).hexdigest()[:16]


class Watch:
    """Hooks on the model and the optimizer: forwards, autocast, LRs, progress, the fault
    (in the forward pass of the kill step, so that a step the GradScaler skips cannot skip it)."""

    def __init__(self, net: nn.Module, device_type: str, rank: int) -> None:
        self.device_type, self.rank = device_type, rank
        self.kill_at: Optional[tuple[int, int]] = None  # (epoch 0-based, step) on this rank
        self.counting = True
        self.epoch, self.epochs, self.steps_per_epoch = 0, 1, 1
        self.new_epoch(0)
        net.register_forward_hook(self.forward)

    def new_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.forwards = self.under_autocast = 0
        self.dtypes: set[str] = set()
        self.lrs: list[list[float]] = []
        self.eval_samples = self.eval_forwards_with_grad = 0

    def forward(self, net: nn.Module, inputs: Any, _output: Any) -> None:
        if not self.counting:
            return
        if not net.training:
            self.eval_samples += len(inputs[0])
            self.eval_forwards_with_grad += int(torch.is_grad_enabled())
            return
        self.forwards += 1
        if torch.is_autocast_enabled(self.device_type):
            self.under_autocast += 1
            self.dtypes.add(dtype_name(torch.get_autocast_dtype(self.device_type)))
        if self.kill_at == (self.epoch, self.forwards - 1):
            self.die()

    def die(self) -> None:
        """The fault: this rank ends at once, with no exception and no cleanup (SIGKILL)."""
        step = self.forwards - 1
        events.emit("metric", name="fault", rank=self.rank, epoch=self.epoch + 1, step=step)
        print(f"fault injection: killing rank {self.rank} (SIGKILL) in step {step} of epoch "
              f"{self.epoch + 1}", flush=True)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Before every optimizer step (a GradScaler skips some): its LR, and progress."""
        step = max(self.forwards - 1, 0)
        self.lrs.append([self.epoch * self.steps_per_epoch + step,
                         float(optimizer.param_groups[0]["lr"])])
        if self.rank == 0 and (step + 1) % max(1, self.steps_per_epoch // 4) == 0:
            events.emit("progress", epoch=self.epoch + 1, epochs=self.epochs, step=step + 1,
                        steps=self.steps_per_epoch)


class FileWatch:
    """Who opens files for writing in the checkpoint folder, and who renames onto the file."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.folder = os.path.dirname(self.path)
        self.active = False
        self.reset()
        sys.addaudithook(self.audit)

    def reset(self) -> None:
        self.opened: list[str] = []
        self.renamed = False

    def audit(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            mode, flags = args[1], args[2]
            writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                       else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
            if writing and os.path.dirname(path) == self.folder:
                self.opened.append(os.path.basename(path))
        elif event == "os.rename" and isinstance(args[1], (str, bytes, os.PathLike)):
            self.renamed |= os.path.abspath(os.fsdecode(args[1])) == self.path


def bytes_written() -> Optional[int]:
    """Bytes this process has written so far (``/proc/self/io`` wchar), None where unknown."""
    try:
        with open("/proc/self/io") as file:
            for line in file:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def tensor_sum(tree: Any) -> float:
    """The float64 sum of every floating tensor in a nested state (equal states, equal sums)."""
    if isinstance(tree, torch.Tensor):
        return float(tree.detach().double().sum()) if tree.is_floating_point() else 0.0
    if isinstance(tree, dict):
        return sum(tensor_sum(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_sum(v) for v in tree)
    return 0.0


def on_disk(path: str) -> Any:
    """The epoch in the checkpoint file now, ``"missing"`` or ``"unreadable"``."""
    if not os.path.exists(path):
        return "missing"
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])
    except Exception:  # noqa: BLE001 - a half-written or foreign file is a fact to report
        return "unreadable"


def devices_of(read: Callable[[], Any]) -> Any:
    """The devices of the ``model`` tensors that ``read()`` returns, or the error it raised."""
    try:
        state = read()
        return sorted({str(t.device) for t in state["model"].values()})
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - reported to the judge
        return f"{type(error).__name__}: {str(error)[:200]}"


# ------------------------------------------------------------------ the run


def join_group(info: dist.DistInfo) -> None:
    """A process group even for one process, so that DDP and barriers work at every size."""
    if torch_dist.is_initialized():
        return
    if "MASTER_ADDR" in os.environ:
        torch_dist.init_process_group(info.backend, rank=0, world_size=1)
    else:  # plain `python exercises/capstone.py`
        store = os.path.join(tempfile.mkdtemp(prefix="ddplab-capstone-"), "store")
        torch_dist.init_process_group(info.backend, init_method=f"file://{store}", rank=0,
                                      world_size=1)


def run(solution: ModuleType, argv: Optional[Sequence[str]] = None) -> Optional[dict[str, Any]]:
    """Run the capstone with the nine functions of ``solution``; return the summary.

    A function still empty (``NotImplementedError``) ends the run cleanly, every rank reporting
    which one (``metric`` event ``todo``): the judge then says what to write first.
    """
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = dist.setup()
    if args.kill_rank is not None and not 0 <= args.kill_rank < info.world_size:
        raise SystemExit(f"--kill-rank {args.kill_rank}: this job has ranks 0 to "
                         f"{info.world_size - 1}; kill one of them.")
    join_group(info)
    pinning.pin_cpu_rank(info)
    folder = args.checkpoint_dir or os.path.join(tempfile.gettempdir(), "ddplab-capstone-" + (
        os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "local")))
    try:
        summary = _run(solution, args, info, os.path.join(folder, CHECKPOINT))
    except NotImplementedError as error:  # every rank stops at the same empty function
        name = _todo_name(error)
        events.emit("metric", name="todo", value=name)
        dist.print0(f"`{name}` is still empty: write it as its docstring says, then launch "
                    "again.", file=sys.stderr)
        summary = None
    if not args.checkpoint_dir:
        dist.barrier()
        if info.is_main:
            shutil.rmtree(folder, ignore_errors=True)
    dist.cleanup()
    return summary


def _todo_name(error: NotImplementedError) -> str:
    frame = error.__traceback__
    name = "?"
    while frame is not None:
        name = frame.tb_frame.f_code.co_name
        frame = frame.tb_next
    return name


@dataclass
class Job:
    """Everything one rank's run holds, built by ``_start``; the loop passes it around."""

    solution: ModuleType
    args: argparse.Namespace
    info: dist.DistInfo
    path: str
    split: data.DataSplit
    loader: Recorder
    test_shard: Any
    net: nn.Module
    model: nn.Module
    amp_dtype: Optional[torch.dtype]
    scaler: Any
    optimizer: torch.optim.Optimizer
    watch: Watch
    warmup_steps: int
    files: Optional[FileWatch] = None


def _run(solution: ModuleType, args: argparse.Namespace, info: dist.DistInfo,
         path: str) -> dict[str, Any]:
    """Build the run from the learner's functions, resume, then train epoch after epoch."""
    job = _start(solution, args, info, path)
    # [loop]
    start = _resume(job)  # the learner's resume: epochs already done (0 without a file)
    job.files = FileWatch(path)
    history, samples_seen = [], 0
    for epoch in range(start, args.epochs):
        loss, seconds, facts = _train(job, epoch)  # train_epoch, with set_epoch inside
        facts["save"] = _save(job, epoch, late=epoch == start)  # save_checkpoint
        if epoch == start:
            facts["read"] = _read(job)  # read_checkpoint, onto this device and onto meta
        dist.barrier()
        accuracy, facts["eval"] = _evaluate(job)  # evaluate: rank 0's number, or None
        events.emit("metric", name="epoch_facts", value=facts)
        history.append(_record(job, epoch, loss, accuracy, seconds, facts["samples"]))
        samples_seen += facts["samples"]
    # [/loop]
    peak = solution.learning_rate(job.warmup_steps, args.lr, info.world_size, job.warmup_steps)
    summary = train.summarize(
        job.model, info, history, samples_seen=samples_seen, lr=peak,
        batch_size=args.batch_size, grad_accum=1, base_lr=args.lr, start_epoch=start,
        dataset=args.dataset, amp_dtype=dtype_name(job.amp_dtype), seed=args.seed)
    events.emit("metric", name="end", value={"checksum": summary["param_checksum"],
                                             "accuracy": summary["final_accuracy"]})
    return summary


def _start(solution: ModuleType, args: argparse.Namespace, info: dist.DistInfo,
           path: str) -> Job:
    """Data, model, precision and optimizer, each through the learner's function."""
    device, world = info.device, info.world_size
    os.makedirs(os.path.dirname(path), exist_ok=True)
    split = data.load_dataset(args.dataset, root=args.data_root, download=args.download,
                              as_tensors=args.dataset != "cifar10")
    loader = Recorder(solution.make_loader(split.train, args.batch_size, info, args.seed))
    test_shard = data.make_eval_loader(  # the fixed part's own accuracy, to compare
        split.test, 512, num_replicas=world, rank=info.rank, device=device,
        kind="tensor" if isinstance(split.test, TensorDataset) else "dataloader")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    name = args.model or models.default_model(args.dataset)
    net = models.build_model(name, split.num_classes, split.in_channels).to(device)
    watch = Watch(net, device.type, info.rank)
    model = solution.wrap_model(net, info)
    amp_dtype, scaler = solution.mixed_precision(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer.register_step_pre_hook(watch.step)
    watch.steps_per_epoch, watch.epochs = len(loader), args.epochs
    warmup_steps = round(args.warmup_epochs * len(loader))
    return Job(solution, args, info, path, split, loader, test_shard, net, model, amp_dtype,
               scaler, optimizer, watch, warmup_steps)


def _resume(job: Job) -> int:
    """Call the learner's ``resume``; report the setup, with what was on disk before."""
    args, info, path = job.args, job.info, job.path
    first_lr = job.solution.learning_rate(0, args.lr, info.world_size, job.warmup_steps)
    refused = _refuses_pickles(job.solution, info.device)
    found = on_disk(path)
    start = int(job.solution.resume(path, job.model, job.optimizer, job.scaler, info.device))
    if args.kill_rank == info.rank and start < args.kill_epoch:
        job.watch.kill_at = (args.kill_epoch - 1, len(job.loader) // 2)
    events.emit("metric", name="setup", value={
        "world_size": info.world_size, "device_type": info.device.type,
        "wrapper": type(job.model).__name__, "amp_dtype": dtype_name(job.amp_dtype),
        "scaler": _scaler_facts(job.scaler), "base_lr": args.lr,
        "warmup_steps": job.warmup_steps, "steps_per_epoch": len(job.loader),
        "first_lr": first_lr, "epochs": args.epochs, "batch_size": args.batch_size,
        "train_size": len(job.split.train), "test_size": len(job.split.test),
        "weights_only_refuses": refused, "on_disk": found, "start_epoch": start,
        "restored": _restored(path, job.net, job.optimizer) if isinstance(found, int) else None,
        "kill": None if args.kill_rank is None else [args.kill_rank, args.kill_epoch]})
    dist.print0(f"world size {info.world_size}, {info.device}, autocast "
                f"{dtype_name(job.amp_dtype)}, {len(job.loader)} steps per epoch, " +
                (f"resumed after epoch {start}" if start else "starting from epoch 1"))
    return start


def _train(job: Job, epoch: int) -> tuple[float, float, dict[str, Any]]:
    """Call the learner's ``train_epoch``: its loss, its time, and what the hooks saw."""
    job.loader.reset()
    job.watch.new_epoch(epoch)
    train.seed_everything(train.epoch_seed(job.args.seed, epoch, job.info.rank))
    train.sync_device(job.info.device)
    began = time.perf_counter()
    loss = float(job.solution.train_epoch(
        job.model, job.loader, job.optimizer, job.scaler, epoch=epoch, amp_dtype=job.amp_dtype,
        base_lr=job.args.lr, world_size=job.info.world_size, warmup_steps=job.warmup_steps,
        device=job.info.device))
    train.sync_device(job.info.device)
    seconds = time.perf_counter() - began
    watch = job.watch
    return loss, seconds, {
        "epoch": epoch + 1, "samples": job.loader.samples, "order": job.loader.order(),
        "lrs": watch.lrs, "forwards": watch.forwards, "under_autocast": watch.under_autocast,
        "autocast_dtypes": sorted(watch.dtypes), "loss": loss}


def _save(job: Job, epoch: int, late: bool) -> dict[str, Any]:
    """Call the learner's ``save_checkpoint``; report what this rank did and then found."""
    info, files, path = job.info, job.files, job.path
    if info.rank == 0 and late and info.world_size > 1:
        time.sleep(FIRST_SAVE_DELAY_S)  # rank 0 comes late to its first save: a busy disk
    files.reset()
    files.active = True
    before = bytes_written()
    job.solution.save_checkpoint(path, job.model, job.optimizer, job.scaler, epoch + 1,
                                 info.rank)
    after = bytes_written()
    files.active = False
    seen = on_disk(path)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return {"seen": seen, "size": size, "opened": files.opened, "renamed": files.renamed,
            "bytes": None if before is None or after is None else after - before}


def _read(job: Job) -> dict[str, Any]:
    """Where the learner's ``read_checkpoint`` puts tensors: this rank's device, and meta."""
    read, path, device = job.solution.read_checkpoint, job.path, job.info.device
    return {"device": str(device), "own": devices_of(lambda: read(path, device)),
            "meta": devices_of(lambda: read(path, torch.device("meta")))}


def _evaluate(job: Job) -> tuple[Optional[float], dict[str, Any]]:
    """Call the learner's ``evaluate``; then score the test set here too, to compare."""
    wrapper_calls = _count_calls(job.model)
    accuracy = job.solution.evaluate(job.model, job.split.test, job.info.device, job.info.rank)
    watch = job.watch
    facts = {"value": accuracy, "samples": watch.eval_samples,
             "wrapper_forwards": wrapper_calls.stop(), "training_after": job.net.training,
             "with_grad": watch.eval_forwards_with_grad}
    watch.counting = False
    facts["expected"] = train.evaluate(job.net, job.test_shard, job.info.device)
    watch.counting = True
    return accuracy, facts


def _record(job: Job, epoch: int, loss: float, accuracy: Optional[float], seconds: float,
            samples: int) -> dict[str, Any]:
    """The epoch's record (mean loss and samples over ranks); rank 0 emits it."""
    world, device = job.info.world_size, job.info.device
    totals = dist.all_reduce_sum(torch.tensor([loss, samples], dtype=torch.float64,
                                              device=device))
    record = train.EpochRecord(
        epoch=epoch + 1, loss=float(totals[0]) / world,
        accuracy=float("nan") if accuracy is None else float(accuracy),
        epoch_time=seconds, samples_per_s=float(totals[1]) / seconds, samples=int(totals[1]),
        lr=float(job.optimizer.param_groups[0]["lr"]))
    if job.info.is_main:
        events.emit("epoch", **vars(record))
    return vars(record)


def _refuses_pickles(solution: ModuleType, device: torch.device) -> Any:
    """Whether ``read_checkpoint`` refuses a file that holds a pickled Python object."""
    folder = tempfile.mkdtemp(prefix="ddplab-capstone-probe-")
    probe = os.path.join(folder, "pickled.pt")
    try:
        torch.save({"model": {}, "epoch": 0, "args": argparse.Namespace(lr=0.1)}, probe)
        try:
            solution.read_checkpoint(probe, device)
        except NotImplementedError:
            raise
        except Exception:  # noqa: BLE001 - refusing is the right answer
            return True
        return False
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _count_calls:
    """Count forward calls of the (wrapped) model until ``stop()``."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, *_: Any) -> None:
        self.calls += 1

    def stop(self) -> int:
        self.handle.remove()
        return self.calls


def _restored(path: str, net: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bool]:
    """Whether the model's weights and the optimizer's state now equal the file's."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {"model": tensor_sum(state.get("model")) == tensor_sum(net.state_dict()),
            "optimizer": tensor_sum(state.get("optimizer")) ==
            tensor_sum(optimizer.state_dict())}


def _scaler_facts(scaler: Any) -> dict[str, Any]:
    if not isinstance(scaler, torch.amp.GradScaler):
        return {"type": type(scaler).__name__, "enabled": False}
    return {"type": type(scaler).__name__, "enabled": scaler.is_enabled()}
