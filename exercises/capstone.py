"""The capstone (13): write a whole distributed training job, then kill it and resume it.

Given (``ddplab.capstone``, imported below): the command line (``parse_args``; ``--help``
lists it), the data set (``datasets``), the model (``build_model``: the same initial weights
on every rank) and two reports the judge reads (``log_step``, ``log_accuracy``). Everything
else is yours. The job must run unchanged under both launchers::

    python -m ddplab launch --nproc-per-node 2 exercises/capstone.py --checkpoint-dir ckpt/a
    torchrun --standalone --nproc-per-node 2 exercises/capstone.py --checkpoint-dir ckpt/a

What must be true of a run, and why
-----------------------------------

1. **One process per device, one group.** Each process joins the job's process group from
   what the launcher put in its environment (nccl and its own GPU, ``LOCAL_RANK``, when every
   process on the machine gets one; else gloo on the CPU, as 4 processes on a 1-GPU machine:
   the ranks of one collective are all on GPUs or all on the CPU) and leaves it at the end. On a
   GPU a resume must replay the
   run bit for bit: deterministic kernels only (cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG``
   before its first matmul; no cuDNN benchmarking).
2. **Each rank its own share, a new order every epoch.** In one epoch the ranks together read
   the training set once (shares that do not overlap, ``--batch-size`` samples per rank and
   step), shuffled from ``--seed``; every epoch has another order, and an epoch replayed after
   a restart has the same one. The shares are ``DistributedSampler``'s: equal, padded by
   repeating samples where the set does not divide by the world size (nothing dropped), and an
   epoch's last batch may be short (kept). The judge compares every rank's samples, step by
   step, with the reference job's.
3. **One model, two strategies.** ``--strategy ddp`` replicates the model on every rank;
   ``--strategy fsdp`` shards it with FSDP2, each block that holds parameters, then the root,
   so that each rank keeps a part of the weights, gradients and optimizer state. Both train
   alike: the same samples, LRs and (up to rounding) losses.
4. **The optimizer step.** SGD with ``--momentum``. Each step's loss is the cross-entropy of
   the model's output on this rank's batch, and the gradient every rank steps with is the mean
   over all the ranks' batches. Nothing of one step's gradient may leak into the next.
5. **Mixed precision.** The forward pass and the loss run under autocast in ``--amp-dtype``,
   by default bfloat16 on a CPU and float16 on a GPU. float16's narrow range needs the loss
   scaled (a ``GradScaler``, enabled whenever the dtype is float16, on any device).
6. **The learning rate** of step ``s`` (counted from 0 over the whole job, across epochs and
   restarts) climbs linearly over ``--warmup-steps`` steps, from 1/warmup of its peak at step
   0 to the peak, then stays: the peak is ``--lr`` times the world size (the global batch is
   that many times one process's).
7. **Reports.** After every optimizer step, every rank calls ``log_step(step, loss)`` with the
   step number and its own loss. After training, rank 0 calls ``log_accuracy(accuracy)``.
8. **Checkpoints** with ``torch.distributed.checkpoint``, in ``--checkpoint-dir``: after every
   ``--save-every``-th step, mid-epoch too (with the default 8: after steps 7, 15, 23, ...,
   each holding the job as it is once that step is done, so that a resume begins at step 8,
   16, 24, ...). Each save goes to a folder of its own (name them as you like): a save never
   overwrites the last complete checkpoint. A checkpoint holds everything the rest of the job
   depends on: model, optimizer (its momentum), scaler, and where the job is (the step, the
   epoch, and how far into it, in a way that means the same on any number of ranks: samples,
   not steps). It is whole on disk before any rank goes past it.
9. **Resume.** A launch whose folder holds a checkpoint goes on from the newest complete one:
   every tensor read back lands on the reading rank's own device (not on the one that saved
   it). On the same number of ranks it then trains exactly what the unbroken job trained, bit
   for bit; on another number of ranks (a DCP checkpoint loads onto any sharding) it goes on with
   the samples of that epoch not yet trained on (when a position falls inside a global batch,
   from that batch) and ends close to the unbroken job.
10. **Evaluation.** After training, rank 0 scores the whole test set with the trained weights
    in a plain model (never a wrapper that only one rank runs: its forward belongs to every
    rank); the other ranks do not evaluate, but take part in whatever collective gathers the
    weights (under FSDP2, ``get_model_state_dict`` with ``StateDictOptions(full_state_dict=
    True)``). With or without autocast: both are right.

A suggested order, the one in which the judge reads your runs (so that each verdict names
the next thing to write):

a. the DDP job on 2 ranks, with its reports and its saves: items 1, 2, 4-8 and 10;
b. ``--strategy fsdp`` on 2 ranks: item 3's FSDP2 half, and item 10's gathered weights;
c. the resume on the same 2 ranks, after the kill: item 9, bit for bit;
d. the resume on 4 ranks with FSDP2: item 9 on another world size.

The fault: ``--kill-rank 1 --kill-at-step K`` (the given part does it) kills rank 1 with
``SIGKILL`` in step K, with no exception and no cleanup. Notebook 13 launches your job five
times (DDP unbroken, FSDP unbroken, killed, resumed, resumed on 4 ranks) and hands the runs to
``ddplab.check("13", ...)``, which compares them with the reference job step by step.

Lesson: 13.
"""

from __future__ import annotations

from ddplab.capstone import build_model, datasets, log_accuracy, log_step, parse_args


def main() -> None:
    args = parse_args()
    train_set, test_set = datasets(args)
    model = build_model(args)
    # TODO(exercise): the job (see the specification above).


if __name__ == "__main__":
    main()
