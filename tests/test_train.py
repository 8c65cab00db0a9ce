"""The training loop's decisions and steps, in one process (CUDA faked where a GPU decides)."""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddplab import amp, data, dist, events, train

CPU = dist.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                    backend="gloo")


# ---------------------------------------------------------------------- device decisions


def test_device_ids_for_ddp_and_dp() -> None:
    gpu = torch.device("cuda", 1)
    info = dist.DistInfo(1, 1, 2, gpu, "nccl")
    assert info.device_ids == [1]  # DDP's device_ids, decided in dist
    assert CPU.device_ids is None
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=4):
        assert train.dp_device_ids(torch.device("cuda", 0)) == [0, 1, 2, 3]
    assert train.dp_device_ids(torch.device("cpu")) is None


def test_sync_device_only_synchronises_cuda() -> None:
    with mock.patch("torch.cuda.synchronize") as synchronize:
        train.sync_device(torch.device("cpu"))
        synchronize.assert_not_called()
        train.sync_device(torch.device("cuda", 1))
        synchronize.assert_called_once_with(torch.device("cuda", 1))


def test_mode_checks_say_what_to_run() -> None:
    with pytest.raises(ValueError, match="--mode ddp"):
        train.check_mode("single", 2)
    with pytest.raises(ValueError, match="single"):
        train.check_mode("horovod", 1)
    train.check_mode("ddp", 2)


def test_wrap_model_per_mode_on_cpu() -> None:
    model = nn.Linear(2, 2)
    assert train.wrap_model(model, "single", CPU) is model
    assert train.wrap_model(model, "ddp", CPU) is model  # a world of one: no process group
    assert isinstance(train.wrap_model(model, "dp", CPU), nn.DataParallel)
    with pytest.raises(ValueError, match="--mode ddp"):
        train.wrap_model(model, "single", CPU, sync_bn=True)
    two_cpu_ranks = dist.DistInfo(0, 0, 2, torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match="GPUs"):
        train.wrap_model(model, "ddp", two_cpu_ranks, sync_bn=True)
    converted = train.wrap_model(nn.Sequential(nn.BatchNorm2d(3)), "ddp", CPU, sync_bn=True)
    assert isinstance(converted[0], nn.SyncBatchNorm)


# ---------------------------------------------------------------------- accumulation


class _RecordsNoSync(nn.Linear):
    """A linear layer with a DDP-like ``no_sync`` that records which backward ran inside it."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.inside, self.backwards = False, []
        self.weight.register_hook(lambda grad: self.backwards.append(self.inside))

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def test_no_sync_on_all_but_the_last_micro_batch() -> None:
    model = _RecordsNoSync()
    group = [(torch.randn(4, 3), torch.randint(2, (4,))) for _ in range(3)]
    scaler = amp.make_grad_scaler("off", torch.device("cpu"))
    train.accumulate(model, group, scaler, torch.device("cpu"), None)
    assert model.backwards == [True, True, False]


def test_accumulated_gradient_equals_the_full_batch_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    inputs, labels = torch.randn(12, 5), torch.randint(3, (12,))
    nn.functional.cross_entropy(model(inputs), labels).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    group = [(inputs[:6], labels[:6]), (inputs[6:], labels[6:])]
    scaler = amp.make_grad_scaler("off", torch.device("cpu"))
    loss = train.accumulate(model, group, scaler, torch.device("cpu"), None)
    for p, g in zip(model.parameters(), full, strict=True):
        torch.testing.assert_close(p.grad, g)
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model(inputs), labels))
    assert float(loss) == pytest.approx(expected)


def test_micro_batches_keep_a_short_last_group() -> None:
    assert [len(g) for g in train.micro_batches(range(7), 3)] == [3, 3, 1]


# ---------------------------------------------------------------------- epoch, eval, summary


def _events(text: str, kind: str) -> list[dict]:
    found = [events.parse(line) for line in text.splitlines()]
    return [e for e in found if e and e["kind"] == kind]


def test_train_epoch_steps_and_reports_progress(capsys: pytest.CaptureFixture) -> None:
    split = data.synthetic(n_train=40, n_test=8, shape=(1, 4, 4), num_classes=3)
    loader = data.make_loader(split.train, 4)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = train.param_checksum(model)
    loss_sum, steps, samples = train.train_epoch(
        model, loader, optimizer, amp.make_grad_scaler("off", CPU.device), device=CPU.device,
        amp_dtype=None, grad_accum=2, lr=0.1, warmup_steps=0, first_step=0, epoch=1, epochs=1,
        report=True,
    )
    assert (steps, samples) == (5, 40) and loss_sum > 0
    assert train.param_checksum(model) != before
    progress = _events(capsys.readouterr().out, "progress")
    assert 2 <= len(progress) <= 6 and progress[-1]["step"] == progress[-1]["steps"] == 5


def test_evaluate_counts_every_test_sample_once() -> None:
    labels = torch.arange(10) % 4
    inputs = nn.functional.one_hot(labels, 4).float()
    inputs[:3] = nn.functional.one_hot((labels[:3] + 1) % 4, 4).float()  # 3 wrong answers
    loader = data.make_eval_loader(TensorDataset(inputs, labels), 4)
    assert train.evaluate(nn.Identity(), loader, CPU.device) == pytest.approx(0.7)


def test_param_checksum_ignores_wrappers() -> None:
    model = nn.Linear(3, 2)
    expected = float(model.weight.detach().double().sum() + model.bias.detach().double().sum())
    assert train.param_checksum(model) == pytest.approx(expected, abs=0)
    assert train.param_checksum(nn.DataParallel(model)) == train.param_checksum(model)


def test_epoch_seed_differs_per_rank_and_epoch() -> None:
    seeds = {train.epoch_seed(0, e, r) for e in range(3) for r in range(2)}
    assert len(seeds) == 6 and train.epoch_seed(0, 1, 1) == train.epoch_seed(0, 1, 1)


def test_summary_is_emitted_once_with_its_fields(capsys: pytest.CaptureFixture) -> None:
    history = [{"epoch": 1, "loss": 1.0, "accuracy": 0.5, "epoch_time": 2.0,
                "samples_per_s": 10.0},
               {"epoch": 2, "loss": 0.5, "accuracy": 0.8, "epoch_time": 1.0,
                "samples_per_s": 20.0}]
    summary = train.summarize(nn.Linear(2, 2), CPU, history, samples_seen=80, lr=0.2,
                              batch_size=16, grad_accum=2, mode="single")
    (emitted,) = _events(capsys.readouterr().out, "summary")
    assert json.loads(json.dumps(summary)) == {k: v for k, v in emitted.items()
                                               if k not in ("kind", "rank")}
    assert summary["global_batch"] == 32 and summary["samples_seen_per_rank"] == [80]
    assert summary["final_accuracy"] == 0.8 and summary["samples_per_s"] == 20.0
    assert summary["epochs"] == 2 and summary["mode"] == "single"
