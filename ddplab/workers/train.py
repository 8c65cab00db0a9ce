"""Train a model on one or many processes: the worker every lesson launches.

Run it (2 processes with torchrun, or through ddplab's launcher, or alone)::

    torchrun --standalone --nproc-per-node 2 -m ddplab.workers.train --epochs 3
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.train --epochs 3
    python -m ddplab.workers.train --epochs 3                     # one process

Its last output line is one ``summary`` event from rank 0 (``@ddplab {"kind": "summary", ...}``)
with: ``param_checksum`` (float64 sum of all weights) and ``param_checksums_per_rank``,
``final_loss``, ``final_accuracy``, ``epochs``, ``world_size``, ``batch_size`` (per process),
``grad_accum``, ``global_batch``, ``lr`` (effective) and ``base_lr``, ``history`` (per epoch:
``epoch``, ``loss``, ``accuracy``, ``epoch_time``, ``samples_per_s``, ``samples``, ``lr``),
``samples_seen_per_rank`` (samples each rank trained on in this launch), ``samples_per_s``,
``train_time``, ``start_epoch``, ``mode``, ``amp``, ``amp_dtype``, ``dataset``, ``model``,
``loader``, ``seed``, ``set_epoch``, ``sync_bn``, ``device``, ``backend``.

Lessons: 01, 02, 03, 04, 05, 06, 09.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Sequence

import torch

from ddplab import amp, checkpoint, data, dist, models, pinning, schedule, train


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=data.DATASETS, default="digits")
    p.add_argument("--data-root", default="data", help="folder of CIFAR-10 (default: data)")
    p.add_argument("--download", action="store_true", help="fetch CIFAR-10 if it is missing")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, or resnet18 for cifar10")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process (per micro-batch)")
    p.add_argument("--lr", type=float, default=0.05, help="base learning rate (SGD)")
    p.add_argument("--scale-lr", action="store_true", help="lr x world size x grad accum")
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="linear LR warm-up")
    p.add_argument("--amp", choices=amp.AMP_MODES, default="off")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm (ddp, GPUs)")
    p.add_argument("--no-set-epoch", action="store_true", help="skip sampler.set_epoch (bug)")
    p.add_argument("--checkpoint-dir", help="save checkpoint.pt here after every epoch")
    p.add_argument("--resume", nargs="?", const="", metavar="PATH",
                   help="resume from PATH (default: <checkpoint-dir>/checkpoint.pt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after-epoch", type=int, metavar="N", help="crash after epoch N")
    p.add_argument("--mode", choices=train.MODES, default="ddp")
    p.add_argument("--loader", choices=data.LOADERS, default="tensor")
    p.add_argument("--threads", type=int, help="torch CPU threads per process")
    args = p.parse_args(argv)
    if args.resume == "" and not args.checkpoint_dir:
        p.error("--resume without a PATH needs --checkpoint-dir")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run one training job; return its summary (on every rank)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    # [setup]
    # 1. setup: join the process group (if launched with several processes), pick the device
    info = dist.setup()
    train.check_mode(args.mode, info.world_size)
    pinning.pin_cpu_rank(info)  # DDP on CPUs: each rank on cores of its own (lesson 09)
    # [/setup]

    # [data]
    # 2. data: each rank reads its own share; micro-batches interleave shares (see data.py)
    split = data.load_dataset(args.dataset, root=args.data_root, download=args.download,
                              as_tensors=args.loader == "tensor", seed=args.seed)
    on_device = dict(kind=args.loader, device=info.device, batch_transform=split.batch_transform)
    loader = data.make_loader(split.train, args.batch_size, num_replicas=info.world_size,
                              rank=info.rank, interleave=args.grad_accum, seed=args.seed,
                              **on_device)
    test_loader = data.make_eval_loader(split.test, 512, num_replicas=info.world_size,
                                        rank=info.rank, **on_device)
    # [/data]

    # [model]
    # 3. model: same seed on every rank, moved to the device, then wrapped for the mode
    torch.manual_seed(args.seed)
    name = args.model or models.default_model(args.dataset)
    model = models.build_model(name, split.num_classes, split.in_channels).to(info.device)
    model = train.wrap_model(model, args.mode, info, sync_bn=args.sync_bn)
    lr = schedule.effective_lr(args.lr, info.world_size, args.grad_accum, args.scale_lr)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = amp.make_grad_scaler(args.amp, info.device)
    path = os.path.join(args.checkpoint_dir or ".", "checkpoint.pt")
    start, history = 0, []
    if args.resume is not None:
        start, history = train.resume(args.resume or path, model, optimizer, scaler, info.device)
    # [/model]

    # [loop]
    # 4. loop: train, evaluate, 5. save (rank 0 writes, everyone waits)
    samples_seen = 0
    for epoch in range(start, args.epochs):
        record, samples = train.fit_epoch(
            model, loader, test_loader, optimizer, scaler, info=info, epoch=epoch,
            epochs=args.epochs, seed=args.seed, amp=args.amp, grad_accum=args.grad_accum,
            lr=lr, warmup_epochs=args.warmup_epochs, set_epoch=not args.no_set_epoch,
        )
        history.append(vars(record))
        samples_seen += samples
        if args.checkpoint_dir:
            checkpoint.save_checkpoint(path, model, optimizer, scaler=scaler, epoch=epoch + 1,
                                       sampler_epoch=epoch + 1, extra={"history": history})
        if args.stop_after_epoch == epoch + 1:
            train.stop_after(epoch + 1)
    # [/loop]

    summary = train.summarize(
        model, info, history, samples_seen=samples_seen, lr=lr, batch_size=args.batch_size,
        grad_accum=args.grad_accum, base_lr=args.lr, start_epoch=start, mode=args.mode,
        amp=args.amp, amp_dtype=amp.dtype_name(amp.autocast_dtype(args.amp, info.device.type)),
        dataset=args.dataset, model=name, loader=args.loader, seed=args.seed,
        set_epoch=not args.no_set_epoch, sync_bn=args.sync_bn,
    )

    # [cleanup]
    # 6. cleanup: leave the process group
    dist.cleanup()
    # [/cleanup]
    return summary


if __name__ == "__main__":
    main()
