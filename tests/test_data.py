"""Datasets, DistributedSampler behaviour and the two loaders (no processes, no downloads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from ddplab import data


@pytest.fixture(scope="module")
def digits() -> data.DataSplit:
    return data.digits()


def test_digits_reads_the_same_data_as_sklearn() -> None:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images, labels = data._digits_arrays()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)


def test_digits_split_is_fixed_disjoint_normalised(digits: data.DataSplit) -> None:
    x_train, y_train = digits.train.tensors
    x_test, y_test = digits.test.tensors
    assert x_train.shape == (1347, 1, 8, 8) and x_test.shape == (450, 1, 8, 8)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    assert abs(float(x_train.mean())) < 1e-4 and abs(float(x_train.std()) - 1) < 1e-3
    assert set(y_test.tolist()) == set(range(10))
    again = data.digits()
    assert torch.equal(again.test.tensors[0], x_test)
    # no test image is also a training image (the digits set has a few exact duplicates of its
    # own, so compare indices of the split rather than pixels)
    train_idx, test_idx = data.stratified_split(data._digits_arrays()[1], 0.25, 0)
    assert not set(train_idx) & set(test_idx) and len(train_idx) + len(test_idx) == 1797


def test_synthetic_has_the_requested_shape() -> None:
    split = data.synthetic(n_train=20, n_test=8, shape=(2, 5, 7), num_classes=3, seed=1)
    x, y = split.train.tensors
    assert x.shape == (20, 2, 5, 7) and int(y.max()) < 3
    assert split.in_channels == 2 and split.num_classes == 3
    assert torch.equal(data.synthetic(20, 8, (2, 5, 7), 3, seed=1).train.tensors[0], x)


def test_cifar10_missing_names_both_ways_out(tmp_path) -> None:
    with pytest.raises(data.DatasetNotFoundError) as info:
        data.cifar10(str(tmp_path), download=False)
    assert "--data-root" in str(info.value) and "--download" in str(info.value)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="digits"):
        data.load_dataset("mnist")
    with pytest.raises(ValueError, match="tensor"):
        data.make_loader(data.synthetic(8, 4).train, 4, kind="fast")


# ---------------------------------------------------------------------------------- sampler


def _shares(length: int, world: int, epoch: int = 0, **kwargs) -> list[list[int]]:
    """Every rank's indices for one epoch, from the worker's own samplers."""
    samplers = [data.make_sampler(range(length), world, rank, **kwargs) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


def test_shares_are_disjoint_and_cover_with_padding() -> None:
    shares = _shares(10, 4, epoch=0)  # 10 does not divide by 4: 2 padding repeats
    assert [len(s) for s in shares] == [3, 3, 3, 3]
    flat = [i for share in shares for i in share]
    assert set(flat) == set(range(10))
    assert len(flat) - len(set(flat)) == 2
    even = _shares(12, 4, epoch=0)
    assert sorted(i for share in even for i in share) == list(range(12))


def test_drop_last_drops_the_tail_instead() -> None:
    shares = _shares(10, 4, epoch=0, drop_last=True)
    flat = [i for share in shares for i in share]
    assert [len(s) for s in shares] == [2, 2, 2, 2] and len(set(flat)) == 8


def test_set_epoch_changes_the_order_and_without_it_it_repeats() -> None:
    sampler = data.make_sampler(range(50), num_replicas=2, rank=0, seed=0)
    first = list(sampler)
    assert list(sampler) == first  # no set_epoch: epoch 2 repeats epoch 1
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and set(second) | set(_shares(50, 2, epoch=1)[1]) == set(
        range(50)
    )


def test_sampler_without_process_group_defaults_to_one_replica() -> None:
    sampler = data.make_sampler(range(7))
    assert sorted(sampler) == list(range(7))


# ---------------------------------------------------------------------------------- loaders


def test_interleaved_batches_are_what_each_rank_would_read() -> None:
    dataset = TensorDataset(torch.arange(21).float().view(21, 1), torch.arange(21))
    single = data.make_loader(dataset, 4, interleave=2, seed=3)
    ranks = [data.make_loader(dataset, 4, num_replicas=2, rank=r, seed=3) for r in range(2)]
    for epoch in (0, 1):
        single.set_epoch(epoch)
        for loader in ranks:
            loader.set_epoch(epoch)
        expected = [b for pair in zip(*[list(r) for r in ranks], strict=True) for b in pair]
        got = list(single)
        assert len(got) == len(single) == len(expected) == 6
        for (x, y), (ex, ey) in zip(got, expected, strict=True):
            assert torch.equal(y, ey) and torch.equal(x, ex)


def test_tensor_loader_and_dataloader_yield_the_same_batches() -> None:
    split = data.synthetic(n_train=37, n_test=5, shape=(1, 3, 3), seed=2)
    fast = data.make_loader(split.train, 8, kind="tensor", seed=5)
    slow = data.make_loader(split.train, 8, kind="dataloader", seed=5)
    assert isinstance(fast, data.TensorLoader) and isinstance(slow, data.EpochDataLoader)
    fast.set_epoch(2)
    slow.set_epoch(2)
    pairs = list(zip(fast, slow, strict=True))
    assert len(pairs) == 5
    for (fx, fy), (sx, sy) in pairs:
        assert torch.equal(fx, sx) and torch.equal(fy, sy)


def test_eval_shards_cover_the_test_set_exactly_once() -> None:
    dataset = TensorDataset(torch.zeros(11, 1), torch.arange(11))
    seen = []
    for rank in range(3):
        for _, labels in data.make_eval_loader(dataset, 2, num_replicas=3, rank=rank):
            seen += labels.tolist()
    assert sorted(seen) == list(range(11))


def test_batch_transform_normalises_uint8_batches() -> None:
    images = torch.full((2, 3, 2, 2), 255, dtype=torch.uint8)
    dataset = TensorDataset(images, torch.zeros(2, dtype=torch.int64))
    loader = data.make_loader(dataset, 2, batch_transform=data.normalize_uint8_images)
    (x, _), = list(loader)
    expected = (1 - torch.tensor(data.CIFAR10_MEAN)) / torch.tensor(data.CIFAR10_STD)
    assert x.dtype == torch.float32
    torch.testing.assert_close(x[0, :, 0, 0], expected)


def test_tensor_loader_refuses_a_per_sample_dataset() -> None:
    with pytest.raises(TypeError, match="dataloader"):
        data.make_loader(list(range(4)), 2, kind="tensor")
