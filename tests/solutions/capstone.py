"""A right capstone job in another style than the reference (the tests run it; the notebook
never shows it): a Stateful application state for DCP, a sampler that skips what a checkpoint
says was done, ``model.module`` for DDP's evaluation and the gathered full state for FSDP's,
the LR from a LambdaLR scheduler made once the checkpoint says which step the job is at."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddplab.capstone import build_model, datasets, log_accuracy, log_step, parse_args


class Skipping(DistributedSampler):
    """A DistributedSampler that leaves out the first ``skip`` indices of this rank's share."""

    skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self):
        return super().__len__() - self.skip


class Job(Stateful):
    def __init__(self, model, optimizer, scaler):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.step = self.epoch = self.samples = 0

    def state_dict(self):
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "scaler": self.scaler.state_dict(),
                "step": self.step, "epoch": self.epoch, "samples": self.samples}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.samples = state["step"], state["epoch"], state["samples"]


def newest(folder):
    steps = [int(n[5:]) for n in os.listdir(folder) if n.startswith("ckpt-")
             and os.path.isfile(os.path.join(folder, n, ".metadata"))]
    return os.path.join(folder, f"ckpt-{max(steps)}") if steps else None


if __name__ == "__main__":
    args = parse_args()
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpu:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    dist.init_process_group(backend="nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    train_set, test_set = datasets(args)
    net = build_model(args).to(device)
    if args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if list(layer.parameters()):
                fully_shard(layer)
        model = fully_shard(net)
    else:
        model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=args.momentum)
    half = args.amp_dtype == "float16" or (gpu and args.amp_dtype is None)
    dtype = torch.float16 if half else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda" if gpu else "cpu", enabled=half)
    job = Job(model, optimizer, scaler)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    dist.barrier()
    found = newest(args.checkpoint_dir)
    if found:
        dcp.load({"job": job}, checkpoint_id=found)
    for group in optimizer.param_groups:  # the peak of this world size, not the saved one's
        group["initial_lr"] = args.lr * world
    warm = max(args.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm), last_epoch=job.step - 1)

    sampler = Skipping(train_set, shuffle=True, seed=args.seed)
    while job.epoch < args.epochs:
        sampler.set_epoch(job.epoch)
        per_step = args.batch_size * world
        sampler.skip = job.samples // per_step * args.batch_size
        done_before = sampler.skip * world
        for i, (x, y) in enumerate(DataLoader(train_set, batch_size=args.batch_size,
                                              sampler=sampler)):
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step = job.step
            scheduler.step()
            job.step += 1
            log_step(step, loss.item())
            job.samples = done_before + (i + 1) * per_step
            if (step + 1) % args.save_every == 0:
                dcp.save({"job": job}, checkpoint_id=os.path.join(args.checkpoint_dir,
                                                                  f"ckpt-{step + 1}"))
        job.epoch, job.samples = job.epoch + 1, 0

    if args.strategy == "fsdp":
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        plain = build_model(args).to(device) if rank == 0 else None
        if plain is not None:
            plain.load_state_dict(full)
    else:
        plain = model.module if rank == 0 else None
    if rank == 0:
        plain.eval()
        with torch.no_grad():
            x, y = (torch.stack([s[i] for s in test_set]) for i in (0, 1))
            accuracy = (plain(x.to(device)).argmax(-1) == y.to(device)).float().mean().item()
        log_accuracy(accuracy)
    dist.destroy_process_group()
