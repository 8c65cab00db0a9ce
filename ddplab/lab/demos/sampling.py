"""DistributedSampler in pictures: which indices each rank reads, what padding repeats.

Kernel side (see ``ddplab.lab.demos``). Every function builds real ``DistributedSampler``s with
explicit ``num_replicas`` and ``rank`` (so no process group is needed) and returns plain lists
a notebook prints, draws and asserts on::

    shares = sampler_shares(10, world_size=3)            # [[...], [...], [...]]: 4 each
    padding(10, 3)                                       # 12 read, 2 of them repeats
    epoch_orders(10, 3, epochs=3, set_epoch=False)       # the same order every epoch
    distinct_batches(1347, 2, 32, epochs=30, set_epoch=False)   # 22 batches, read 30 times
    never_read(1347, 2, epochs=30, set_epoch=False)      # each rank misses the other's half

``ddplab.lab.widgets.sampler_explorer`` draws the same facts live.

Lesson: 04.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch.utils.data import DistributedSampler


def sampler_shares(dataset_len: int, world_size: int, *, epoch: Optional[int] = 0,
                   shuffle: bool = True, seed: int = 0, drop_last: bool = False
                   ) -> list[list[int]]:
    """Return the indices every rank reads in one epoch, from real ``DistributedSampler``s.

    Args:
        dataset_len: number of samples.
        world_size: number of ranks (``num_replicas``; given explicitly, so no process group
            is needed).
        epoch: the value passed to ``sampler.set_epoch``; None means it is never called.
        shuffle: shuffle with the seed ``seed + epoch`` (the sampler's own rule).
        seed: the sampler seed (the same on every rank).
        drop_last: drop the tail instead of padding with repeated indices.

    Returns:
        ``shares[rank]``: that rank's indices in the order it reads them.

    Lesson: 04.
    """
    shares = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(dataset_len), num_replicas=world_size, rank=rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        if epoch is not None:
            sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def epoch_orders(dataset_len: int, world_size: int, epochs: int, *, set_epoch: bool = True,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False
                 ) -> list[list[list[int]]]:
    """Return ``orders[epoch][rank]``: what each rank reads in each of ``epochs`` epochs.

    With ``set_epoch=False`` the training loop forgets ``sampler.set_epoch(epoch)``, so every
    epoch uses the sampler's default epoch 0 and repeats the same order.

    Lesson: 04.
    """
    return [
        sampler_shares(dataset_len, world_size, epoch=epoch if set_epoch else None,
                       shuffle=shuffle, seed=seed, drop_last=drop_last)
        for epoch in range(epochs)
    ]


def distinct_batches(dataset_len: int, world_size: int, batch_size: int, epochs: int, *,
                     set_epoch: bool = True, rank: int = 0, seed: int = 0) -> dict[str, int]:
    """Count the batches one rank trains on over ``epochs`` epochs, and how many differ.

    A batch is the set of indices the rank's ``DataLoader`` puts together (``batch_size`` at a
    time, in the sampler's order); two batches are the same when they hold the same indices.

    Returns:
        ``{"batches": batches read in all, "distinct": different index sets among them}``.

    Lesson: 04.
    """
    orders = epoch_orders(dataset_len, world_size, epochs, set_epoch=set_epoch, seed=seed)
    batches = [frozenset(order[rank][i:i + batch_size])
               for order in orders for i in range(0, len(order[rank]), batch_size)]
    return {"batches": len(batches), "distinct": len(set(batches))}


def never_read(dataset_len: int, world_size: int, epochs: int, *, set_epoch: bool = True,
               drop_last: bool = True, seed: int = 0) -> dict[str, Any]:
    """Count the samples left unread over ``epochs`` epochs: by each rank, and by all ranks.

    Without ``set_epoch`` every epoch repeats epoch 0's shares, so a rank only ever reads its
    one share, and with ``drop_last`` the same tail of the order is left out every epoch.

    Returns:
        ``{"per_rank": [samples rank r never read], "by_all": samples no rank ever read}``.

    Lesson: 04.
    """
    orders = epoch_orders(dataset_len, world_size, epochs, set_epoch=set_epoch, seed=seed,
                          drop_last=drop_last)
    read = [set().union(*(order[rank] for order in orders)) for rank in range(world_size)]
    return {"per_rank": [dataset_len - len(r) for r in read],
            "by_all": dataset_len - len(set().union(*read))}


def is_padding(position: int, rank: int, dataset_len: int, world_size: int) -> bool:
    """True when a rank's ``position``-th index is a repeat added as padding (drop_last=False).

    ``DistributedSampler`` appends the first indices of the epoch's order to the end of it until
    the length divides by the world size, then gives rank ``r`` every ``world_size``-th index
    starting at ``r``: global slot ``position * world_size + rank``.

    Lesson: 04.
    """
    return position * world_size + rank >= dataset_len


def padding(dataset_len: int, world_size: int, drop_last: bool = False) -> dict[str, Any]:
    """Count what one epoch of ``DistributedSampler`` reads, repeats and leaves out.

    Returns:
        ``{"per_rank", "read", "repeats", "unread"}``: indices per rank, indices read in total,
        how many of them are repeats, how many samples no rank reads this epoch.

    Lesson: 04.
    """
    shares = sampler_shares(dataset_len, world_size, shuffle=False, drop_last=drop_last)
    read = [i for share in shares for i in share]
    return {"per_rank": len(shares[0]), "read": len(read), "repeats": len(read) - len(set(read)),
            "unread": dataset_len - len(set(read))}


def padded_accuracy(correct: Sequence[bool], world_size: int) -> tuple[float, float]:
    """Score predictions exactly, and as an evaluation sharded by ``DistributedSampler`` would.

    Args:
        correct: ``correct[i]`` is True when the model is right on test sample ``i``.
        world_size: number of ranks sharing the evaluation.

    Returns:
        ``(true accuracy, accuracy from the padded shares)``: the padding repeats samples, so
        the second number counts some samples twice.

    Lesson: 04.
    """
    shares = sampler_shares(len(correct), world_size, shuffle=False)
    scored = [bool(correct[i]) for share in shares for i in share]
    return sum(map(bool, correct)) / len(correct), sum(scored) / len(scored)


def by_epoch_and_rank(events: Sequence[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Index a training run's ``epoch`` events by ``(epoch, rank)``.

    Lesson: 04.
    """
    return {(e["epoch"], e["rank"]): e for e in events}


def side_by_side(with_set: dict[tuple[int, int], dict[str, Any]],
                 without: dict[tuple[int, int], dict[str, Any]], first: int = 6
                 ) -> list[dict[str, Any]]:
    """One row per (epoch, rank): the first indices read and the loss, in both runs.

    The losses are text with 6 decimals, so that two losses that print alike in the table agree
    to that digit (a table's float would show only 4 significant digits).

    Args:
        with_set, without: ``by_epoch_and_rank`` of the run with ``set_epoch`` and without it.
        first: how many of the epoch's first indices to show.

    Lesson: 04.
    """
    return [{"epoch": epoch, "rank": rank,
             "first indices, set_epoch": with_set[epoch, rank]["order"][:first],
             "no set_epoch": without[epoch, rank]["order"][:first],
             "loss, set_epoch": f"{with_set[epoch, rank]['loss']:.6f}",
             "loss, no set_epoch": f"{without[epoch, rank]['loss']:.6f}"}
            for epoch, rank in sorted(with_set)]


def identical_loss_epochs(with_set: dict[tuple[int, int], dict[str, Any]],
                          without: dict[tuple[int, int], dict[str, Any]]) -> set[int]:
    """The epochs in which every rank reported the same loss in both runs.

    Lesson: 04.
    """
    epochs = {epoch for epoch, _rank in with_set}
    return {epoch for epoch in epochs
            if all(with_set[key]["loss"] == without[key]["loss"]
                   for key in with_set if key[0] == epoch)}
