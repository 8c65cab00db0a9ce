"""Runnable worker scripts, one per lesson; each starts with the command that runs it.

For example the training worker (single / DataParallel / DDP, AMP, accumulation, checkpoints)::

    torchrun --standalone --nproc-per-node 2 -m ddplab.workers.train --epochs 3

Workers live on the worker side: they import ``ddplab.train``, ``data``, ``models``,
``checkpoint``, ``dist`` and ``events``, never the launcher, plots or widgets.
"""
