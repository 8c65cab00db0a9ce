"""Datasets (digits by default, CIFAR-10, synthetic) and the loaders that feed each rank.

Three datasets, one shape of result (a ``DataSplit``):

- ``digits()``: scikit-learn's bundled 8x8 handwritten digits (1797 images, no download), split
  once with a fixed seed into 1347 training and 450 test images, as normalised ``1x8x8`` floats.
  A small CNN learns it to >90% test accuracy in a few CPU seconds: the default of every lesson.
- ``cifar10(root, download=False)``: torchvision's CIFAR-10, read from ``root``; it is fetched
  only when you ask (``download=True`` or the worker's ``--download``).
- ``synthetic(...)``: random images of any shape and class count, for speed tests.

Two loaders over the same batches of indices, so a benchmark can compare them:

- ``TensorLoader`` (``kind="tensor"``): the whole dataset lives on the device as one tensor and a
  batch is one ``index_select``; no per-sample Python work at all (the fast path).
- ``EpochDataLoader`` (``kind="dataloader"``): the classic ``torch.utils.data.DataLoader`` that
  fetches and collates sample by sample, as in torchvision tutorials.

Which indices a process reads comes from ``torch.utils.data.DistributedSampler``::

    sampler = make_sampler(train_set, num_replicas=2, rank=0, seed=0)   # no process group needed
    sampler.set_epoch(epoch)                 # forget this and every epoch repeats the same order
    loader = make_loader(train_set, 32, num_replicas=info.world_size, rank=info.rank)

Lessons: 01 (data on the device), 03 (per-process vs global batch), 04 (DistributedSampler,
set_epoch, padding), 09 (tensor loader vs DataLoader).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Sized, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from ddplab import dist

DATASETS = ("digits", "cifar10", "synthetic")
LOADERS = ("tensor", "dataloader")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

Batch = tuple[torch.Tensor, torch.Tensor]
BatchTransform = Callable[[torch.Tensor], torch.Tensor]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is not on disk and downloading it was not requested."""


@dataclass(frozen=True)
class DataSplit:
    """A dataset's train and test parts plus what a model needs to know about them.

    ``batch_transform`` (if set) turns a raw batch into model input on the device; the tensor
    fast path stores CIFAR-10 as uint8 and normalises each batch, which keeps 50,000 images at
    150 MB instead of 600 MB per process.
    """

    name: str
    train: Dataset
    test: Dataset
    num_classes: int
    in_channels: int
    batch_transform: Optional[BatchTransform] = None


# ---------------------------------------------------------------------------------- datasets


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Read scikit-learn's bundled digits file: ``(images (1797, 8, 8), labels (1797,))``.

    This reads the same ``digits.csv.gz`` that ``sklearn.datasets.load_digits()`` reads (a test
    checks they agree) without importing scikit-learn, which would add about two seconds to the
    start of every worker process.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the digits dataset ships with scikit-learn: install it with `pip install "
            "scikit-learn` (it is a ddplab dependency), or use --dataset synthetic."
        )
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into train and test with the same class balance in both, reproducibly.

    Args:
        labels: one integer label per sample.
        test_fraction: share of each class that goes to the test part.
        seed: the split's seed; the same seed always gives the same split.

    Returns:
        ``(train_indices, test_indices)``, each sorted.

    Lesson: 01.
    """
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_test = int(round(len(members) * test_fraction))
        test.append(members[:n_test])
        train.append(members[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def digits(test_fraction: float = 0.25, split_seed: int = 0) -> DataSplit:
    """Load the 8x8 digits as normalised ``1x8x8`` float tensors with a fixed train/test split.

    Pixels (0..16) are scaled to [0, 1] and standardised with the training set's mean and
    standard deviation, so the test set never leaks into the normalisation.

    Args:
        test_fraction: share of the images held out for testing (450 of 1797 by default).
        split_seed: seed of the split; keep it fixed so every run is scored on the same images.

    Returns:
        A ``DataSplit`` of two ``TensorDataset(images, labels)`` with 10 classes, 1 channel.

    Lesson: 01 (and every lesson's default workload).
    """
    images, labels = _digits_arrays()
    train_idx, test_idx = stratified_split(labels, test_fraction, split_seed)
    x = torch.from_numpy(images).float().div_(16.0).unsqueeze(1)
    y = torch.from_numpy(labels)
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    train = TensorDataset(x[train_idx].contiguous(), y[train_idx].contiguous())
    test = TensorDataset(x[test_idx].contiguous(), y[test_idx].contiguous())
    return DataSplit("digits", train, test, num_classes=10, in_channels=1)


def synthetic(
    n_train: int = 2048,
    n_test: int = 512,
    shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    seed: int = 0,
) -> DataSplit:
    """Make random images of any shape: class prototypes plus noise (learnable, but meaningless).

    Args:
        n_train: number of training images.
        n_test: number of test images.
        shape: ``(channels, height, width)`` of one image.
        num_classes: number of classes.
        seed: the data's seed (the same seed gives the same tensors).

    Returns:
        A ``DataSplit`` of two ``TensorDataset``.

    Lesson: 09 (throughput without a download).
    """
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, *shape, generator=gen)

    def make(n: int) -> TensorDataset:
        y = torch.randint(num_classes, (n,), generator=gen)
        return TensorDataset(prototypes[y] + 2.0 * torch.randn(n, *shape, generator=gen), y)

    return DataSplit("synthetic", make(n_train), make(n_test), num_classes, int(shape[0]))


def cifar10(root: str = "data", download: bool = False, as_tensors: bool = True) -> DataSplit:
    """Load CIFAR-10 from ``root``, downloading it only when asked.

    With several processes and ``download=True``, rank 0 downloads while the others wait at a
    barrier, so the archive is never fetched twice into the same folder.

    Args:
        root: folder that holds (or will hold) ``cifar-10-batches-py``.
        download: fetch the dataset (~170 MB) into ``root`` if it is missing.
        as_tensors: True for the tensor fast path (uint8 tensors, normalised per batch); False
            for torchvision datasets that convert and normalise each image on access.

    Returns:
        A ``DataSplit`` with 10 classes and 3 channels.

    Raises:
        DatasetNotFoundError: the files are not under ``root`` and ``download`` is False.

    Lesson: 01 and 09 with the GPU workload (CIFAR-10 + ResNet).
    """
    import torchvision  # imported here: only the CIFAR workload pays for it
    from torchvision import transforms

    if download:  # rank 0 fetches, the others wait at the barrier inside save_on_main
        dist.save_on_main(lambda: _cifar_sets(torchvision, root, True, None))
    transform = None if as_tensors else transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    )
    try:
        train, test = _cifar_sets(torchvision, root, False, transform)
    except RuntimeError as error:
        raise DatasetNotFoundError(
            f"CIFAR-10 was not found under {os.path.abspath(root)!r} ({error}). Either point "
            "--data-root (data_root=...) at the folder that holds cifar-10-batches-py, or pass "
            "--download (download=True) to fetch it (~170 MB) once."
        ) from None
    if not as_tensors:
        return DataSplit("cifar10", train, test, 10, 3)
    return DataSplit(
        "cifar10", _cifar_tensors(train), _cifar_tensors(test), 10, 3, normalize_uint8_images
    )


def _cifar_sets(torchvision, root: str, download: bool, transform) -> tuple[Dataset, Dataset]:
    """Build torchvision's CIFAR10 train and test sets."""
    make = torchvision.datasets.CIFAR10
    return (
        make(root, train=True, download=download, transform=transform),
        make(root, train=False, download=download, transform=transform),
    )


def _cifar_tensors(dataset) -> TensorDataset:
    """Turn a torchvision CIFAR10 set into ``TensorDataset(uint8 NCHW images, labels)``."""
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    return TensorDataset(images, torch.tensor(dataset.targets, dtype=torch.int64))


def normalize_uint8_images(images: torch.Tensor) -> torch.Tensor:
    """Scale a uint8 CIFAR batch to [0, 1] and normalise it per channel, on its own device.

    Lesson: 09 (the tensor fast path).
    """
    mean = torch.tensor(CIFAR10_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


def load_dataset(
    name: str = "digits",
    *,
    root: str = "data",
    download: bool = False,
    as_tensors: bool = True,
    seed: int = 0,
) -> DataSplit:
    """Return the dataset called ``name`` (``digits``, ``cifar10`` or ``synthetic``).

    Args:
        name: one of ``DATASETS``.
        root: where CIFAR-10 lives (ignored by the others).
        download: allow fetching CIFAR-10.
        as_tensors: tensor datasets for the fast path (only changes CIFAR-10).
        seed: seed of the synthetic data (digits always use the same split).

    Returns:
        A ``DataSplit``.

    Lesson: every lesson that launches the training worker.
    """
    if name == "digits":
        return digits()
    if name == "synthetic":
        return synthetic(seed=seed)
    if name == "cifar10":
        return cifar10(root, download=download, as_tensors=as_tensors)
    raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}.")


# ---------------------------------------------------------------------------------- samplers


def make_sampler(
    dataset: Sized,
    num_replicas: Optional[int] = None,
    rank: Optional[int] = None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> DistributedSampler:
    """Build a ``DistributedSampler``: this rank's share of the indices of ``dataset``.

    Every rank gets ``ceil(len / num_replicas)`` indices; when the length does not divide, the
    first indices are repeated as padding (``drop_last=False``) or the tail is dropped
    (``drop_last=True``). The order is a permutation seeded by ``seed + epoch``: call
    ``sampler.set_epoch(epoch)`` before each epoch or every epoch repeats the same order.

    Args:
        dataset: anything with a length.
        num_replicas: number of ranks; None asks the process group (which must exist then).
        rank: this rank; None asks the process group.
        shuffle: shuffle (True) or keep the dataset order.
        seed: must be the same on every rank, or the shares overlap.
        drop_last: drop the tail instead of padding with repeats.

    Returns:
        The sampler (give it to a DataLoader as ``sampler=``, never together with
        ``shuffle=True``).

    Lesson: 04.
    """
    if dist.get_world_size() == 1:  # no process group: a world of one, not an error
        num_replicas = 1 if num_replicas is None else num_replicas
        rank = 0 if rank is None else rank
    return DistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
        drop_last=drop_last,
    )


class ShardedBatches:
    """Batches of indices for one process, taken in turn from one or more samplers.

    With one sampler this is simply that sampler's order cut into batches. With ``k`` samplers
    (the shares of ``k`` virtual ranks) it yields batch 0 of share 0, batch 0 of share 1, ...,
    batch 0 of share k-1, then batch 1 of each share, and so on. A single process that
    accumulates gradients over ``k`` micro-batches therefore sees, per optimizer step, exactly
    the samples that ``k`` DDP ranks see in one step (``make_loader(..., interleave=k)``).
    """

    def __init__(self, samplers: Sequence[Sized], batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        self.samplers = list(samplers)
        self.batch_size = batch_size

    def set_epoch(self, epoch: int) -> None:
        """Reseed every sampler's shuffle for ``epoch``."""
        for sampler in self.samplers:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)

    def index_batches(self) -> list[torch.Tensor]:
        """Return this epoch's batches as int64 index tensors, in the order they are used."""
        shares = [torch.as_tensor(list(iter(s)), dtype=torch.int64) for s in self.samplers]
        chunks = [share.split(self.batch_size) for share in shares]
        return [chunk[step] for step in range(len(chunks[0])) for chunk in chunks]

    def __iter__(self) -> Iterator[list[int]]:
        return (batch.tolist() for batch in self.index_batches())

    def __len__(self) -> int:
        return len(self.samplers) * math.ceil(len(self.samplers[0]) / self.batch_size)


class TensorLoader:
    """Batches cut from tensors that live on the device: one ``index_select`` per batch.

    Args:
        dataset: a ``TensorDataset`` of ``(inputs, labels)``.
        batches: where the indices come from (a ``ShardedBatches``).
        device: where to keep the tensors (the rank's device).
        batch_transform: applied to each input batch on the device (for uint8 images).

    Lesson: 01 and 09 (the fast path).
    """

    def __init__(
        self,
        dataset: TensorDataset,
        batches: ShardedBatches,
        device: Union[str, torch.device] = "cpu",
        batch_transform: Optional[BatchTransform] = None,
    ) -> None:
        self.device = torch.device(device)
        self.inputs, self.labels = (t.to(self.device) for t in dataset.tensors)
        self.batches = batches
        self.batch_transform = batch_transform

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shuffle for ``epoch`` (see ``make_sampler``)."""
        self.batches.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        for index in self.batches.index_batches():
            index = index.to(self.device, non_blocking=True)
            inputs = self.inputs.index_select(0, index)
            if self.batch_transform is not None:
                inputs = self.batch_transform(inputs)
            yield inputs, self.labels.index_select(0, index)

    def __len__(self) -> int:
        return len(self.batches)


class EpochDataLoader(DataLoader):
    """A ``DataLoader`` over ``ShardedBatches`` that also has ``set_epoch``, like TensorLoader.

    Lesson: 09 (the per-sample path the tensor loader is compared with).
    """

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shuffle for ``epoch`` (see ``make_sampler``)."""
        self.batch_sampler.set_epoch(epoch)


Loader = Union[TensorLoader, EpochDataLoader]


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_replicas: int = 1,
    rank: int = 0,
    interleave: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    kind: str = "tensor",
    device: Union[str, torch.device] = "cpu",
    batch_transform: Optional[BatchTransform] = None,
    num_workers: int = 0,
) -> Loader:
    """Build the training loader of one rank.

    The dataset is cut into ``num_replicas * interleave`` shares by ``DistributedSampler``
    (virtual rank ``rank * interleave + k`` for ``k < interleave``) and this process takes a
    batch from each of its ``interleave`` shares in turn (see ``ShardedBatches``). With
    ``interleave=1`` that is the standard sampler of DDP rank ``rank``. Passing the gradient
    accumulation count as ``interleave`` makes the samples of each optimizer step depend only on
    the global batch: one process with 2 micro-batches of b sees what 2 DDP ranks with b see.

    Args:
        dataset: the training set.
        batch_size: samples per batch (per micro-batch, per process).
        num_replicas: number of processes.
        rank: this process's rank.
        interleave: shares read in turn by this process (the gradient accumulation count).
        shuffle: shuffle the order (seeded by ``seed`` and the epoch).
        seed: sampler seed, the same on every rank.
        drop_last: drop the tail instead of padding shares with repeated indices.
        kind: ``"tensor"`` (data on the device) or ``"dataloader"`` (per-sample DataLoader).
        device: where the tensor loader keeps the data.
        batch_transform: per-batch transform of the tensor loader (``DataSplit.batch_transform``).
        num_workers: worker processes of the per-sample DataLoader.

    Returns:
        A loader with ``set_epoch(epoch)``, ``len()`` and batches of ``(inputs, labels)``.

    Lesson: 03, 04, 09.
    """
    replicas = num_replicas * interleave
    samplers = [
        make_sampler(dataset, replicas, rank * interleave + k, shuffle=shuffle, seed=seed,
                     drop_last=drop_last)
        for k in range(interleave)
    ]
    return _loader(dataset, ShardedBatches(samplers, batch_size), kind, device,
                   batch_transform, num_workers)


def make_eval_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_replicas: int = 1,
    rank: int = 0,
    kind: str = "tensor",
    device: Union[str, torch.device] = "cpu",
    batch_transform: Optional[BatchTransform] = None,
) -> Loader:
    """Build the evaluation loader of one rank: every ``num_replicas``-th sample, no padding.

    ``DistributedSampler`` would pad the shares with repeated samples, which counts some test
    images twice. Strided shards without padding cover the test set exactly once, so summing
    correct and total over ranks gives the true accuracy.

    Args:
        dataset: the test set.
        batch_size: samples per batch.
        num_replicas: number of processes.
        rank: this process's rank.
        kind: ``"tensor"`` or ``"dataloader"``.
        device: where the tensor loader keeps the data.
        batch_transform: per-batch transform of the tensor loader.

    Returns:
        A loader of ``(inputs, labels)`` batches over this rank's shard.

    Lesson: 04 (padding biases evaluation).
    """
    shard = range(rank, len(dataset), num_replicas)
    return _loader(dataset, ShardedBatches([shard], batch_size), kind, device,
                   batch_transform, 0)


def _loader(dataset, batches, kind, device, batch_transform, num_workers) -> Loader:
    """Build a tensor loader or a per-sample DataLoader over the same batches."""
    if kind == "tensor":
        if not isinstance(dataset, TensorDataset):
            raise TypeError(
                f"the tensor loader needs a TensorDataset, got {type(dataset).__name__}: load "
                "the data with as_tensors=True or use kind='dataloader' (--loader dataloader)."
            )
        return TensorLoader(dataset, batches, device, batch_transform)
    if kind == "dataloader":
        pin = torch.device(device).type == "cuda"
        return EpochDataLoader(dataset, batch_sampler=batches, num_workers=num_workers,
                               pin_memory=pin)
    raise ValueError(f"unknown loader kind {kind!r}: choose one of {', '.join(LOADERS)}.")
