"""The capstone's reference job: what ``exercises/capstone.py`` asks the learner to write.

Run it (2 processes; ``--help`` lists the options)::

    python -m ddplab launch --nproc-per-node 2 ddplab.workers.capstone --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node 2 -m ddplab.workers.capstone --checkpoint-dir ckpt

Only the data set, the model, the command line and the reports come from ``ddplab.capstone``;
the rest is plain torch.

Lesson: 13.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddplab.capstone import build_model, datasets, log_accuracy, log_step, parse_args


def this_device() -> torch.device:
    """This process's device: its own GPU (``LOCAL_RANK``) when every process on this machine
    gets one, else the CPU (more processes than GPUs, as 4 ranks on a 1-GPU Colab: all on gloo,
    since the ranks of one collective are all on GPUs or all on the CPU)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def deterministic(device: torch.device) -> bool:
    """On a GPU, deterministic kernels only (a resume is compared bit for bit): cuBLAS's fixed
    workspace (read when cuBLAS starts, so before the first matmul), no cuDNN benchmarking.
    The CPU kernels this job uses are deterministic already. Returns whether it switched."""
    if device.type != "cuda":
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return True


def setup() -> tuple[int, int, torch.device]:
    """Join the job's process group: nccl and one GPU per process, else gloo on the CPU."""
    device = this_device()
    deterministic(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def precision(amp_dtype: str | None, device: torch.device) -> tuple[torch.dtype, bool]:
    """Autocast's dtype (``--amp-dtype``, else float16 on a GPU and bfloat16 on a CPU) and
    whether the loss is scaled: for float16 only (its narrow range), on any device."""
    dtype = getattr(torch, amp_dtype or ("float16" if device.type == "cuda" else "bfloat16"))
    return dtype, dtype == torch.float16


# [wrap]
def wrap(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """DDP replicates the model; FSDP2 shards every block with parameters, then the root."""
    if strategy == "ddp":
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard  # public since torch 2.6, the floor

    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block)
    return fully_shard(model)
# [/wrap]


def learning_rate(step: int, base_lr: float, world: int, warmup: int) -> float:
    """The linear scaling rule (the global batch is ``world`` times one process's), warmed up."""
    peak = base_lr * world
    return peak * min(1.0, (step + 1) / warmup) if warmup else peak


# [checkpoint]
def latest(folder: str) -> str | None:
    """The newest complete checkpoint in ``folder`` (DCP writes ``.metadata`` last)."""
    done = [name for name in os.listdir(folder) if name.startswith("step-") and
            os.path.exists(os.path.join(folder, name, ".metadata"))]
    return max(done, key=lambda name: int(name.split("-")[1]), default=None)


def save(folder: str, step: int, model, optimizer, scaler, progress: dict[str, int]) -> None:
    """Every rank writes its part of model and optimizer (DCP), with the scaler and where the
    job is; ``dcp.save`` returns on every rank once the checkpoint is complete."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state, "scaler": scaler.state_dict(),
              "progress": dict(progress)}, checkpoint_id=os.path.join(folder, f"step-{step}"))


def resume(folder: str, model, optimizer, scaler) -> dict[str, int] | None:
    """Load the newest checkpoint into model, optimizer and scaler, whatever the world size
    that wrote it; return where that job was (None: start from the beginning)."""
    name = latest(folder)
    if name is None:
        return None
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state,
             "scaler": scaler.state_dict(), "progress": {"step": 0, "epoch": 0, "samples": 0}}
    dcp.load(state, checkpoint_id=os.path.join(folder, name))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    if state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    return state["progress"]
# [/checkpoint]


# [evaluate]
def evaluate(model, args, test_set, rank: int, device: torch.device) -> float | None:
    """Every rank gathers the full weights (a collective); rank 0 alone scores a plain copy
    of the model on the whole test set."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank != 0:
        return None
    net = build_model(args)
    net.load_state_dict(full)
    net.to(device).eval()
    correct = 0
    with torch.no_grad():
        for inputs, labels in DataLoader(test_set, batch_size=512):
            correct += int((net(inputs.to(device)).argmax(1) == labels.to(device)).sum())
    return correct / len(test_set)
# [/evaluate]


def main() -> None:
    args = parse_args()
    rank, world, device = setup()
    train_set, test_set = datasets(args)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = wrap(build_model(args).to(device), args.strategy, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    amp_dtype, scaled = precision(args.amp_dtype, device)
    scaler = torch.amp.GradScaler(device.type, enabled=scaled)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    dist.barrier()  # the folder exists before any rank looks into it

    # [loop]
    progress = resume(args.checkpoint_dir, model, optimizer, scaler) or \
        {"step": 0, "epoch": 0, "samples": 0}
    step = first = progress["step"]   # first: the step this run starts at (0, or a resume's)
    for epoch in range(progress["epoch"], args.epochs):
        sampler.set_epoch(epoch)  # a new order every epoch, the same after a resume
        done = progress["samples"] // (world * args.batch_size) if epoch == progress["epoch"] else 0
        for i, (inputs, labels) in enumerate(itertools.islice(loader, done, None), start=done):
            inputs, labels = inputs.to(device), labels.to(device)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.lr, world, args.warmup_steps)
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=amp_dtype):
                loss = F.cross_entropy(model(inputs), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            log_step(step, loss.item())
            step += 1
            if step % args.save_every == 0:  # where the job is: the next batch to train on
                save(args.checkpoint_dir, step, model, optimizer, scaler,
                     {"step": step, "epoch": epoch, "samples": (i + 1) * world * args.batch_size})
    # [/loop]
    accuracy = evaluate(model, args, test_set, rank, device)
    if rank == 0:
        trained = f"steps {first}-{step - 1}" if step > first else "no step"
        print(f"test accuracy {accuracy:.4f}; trained {trained} ({step} in the job)", flush=True)
        log_accuracy(accuracy)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
