"""The canonical DDP worker on two real gloo processes: equal weights, orders, checkpoints; and
lesson 01's baseline, the same loop without the distributed lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ddplab
from ddplab.lab.showcode import source
from ddplab.workers import plain_ddp

pytestmark = pytest.mark.slow
TARGET = "ddplab.workers.plain_ddp"


def launch(*args, nprocs=2):
    return ddplab.launch(TARGET, nprocs, args=[str(a) for a in args], quiet=True, live=False,
                         timeout=600)


def metric(run, name):
    """{rank: [event, ...]} of one metric, in the order each rank sent them."""
    found = {}
    for event in run.events_of("metric"):
        if event["name"] == name:
            found.setdefault(event["rank"], []).append(event)
    return found


def orders(run):
    """{rank: [first indices of epoch 1, of epoch 2, ...]}."""
    found = {}
    for event in run.events_of("epoch"):
        found.setdefault(event["rank"], []).append(event["order"])
    return found


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """3 epochs, each rank seeded differently before building the model, a checkpoint per epoch."""
    folder = tmp_path_factory.mktemp("full")
    return launch("--epochs", 3, "--seed-per-rank", "--checkpoint-dir", folder), folder


def test_ddp_broadcasts_rank0_weights_and_keeps_them_equal(full):
    run, _ = full
    assert run.ok, run.error
    wrap = {rank: events[0] for rank, events in metric(run, "wrap").items()}
    assert sorted(wrap) == [0, 1]
    assert wrap[0]["before"] != wrap[1]["before"]                  # different starting weights
    assert wrap[0]["after"] == wrap[1]["after"] == wrap[0]["before"]   # rank 0's, everywhere
    final = {rank: events[-1]["value"] for rank, events in metric(run, "checksum").items()}
    assert final[0] == final[1] != wrap[0]["after"]                # trained, and still equal


def test_each_rank_reads_its_own_half_in_a_new_order_every_epoch(full):
    run, _ = full
    seen = orders(run)
    assert all(len(seen[rank]) == 3 for rank in (0, 1))
    for epoch in range(3):
        assert not set(seen[0][epoch]) & set(seen[1][epoch])      # disjoint shares
    for rank in (0, 1):
        assert len({tuple(order) for order in seen[rank]}) == 3   # set_epoch: new orders
    epochs = [e for e in run.events_of("epoch") if e["rank"] == 0]
    assert [e["samples"] for e in epochs] == [674] * 3             # ceil(1347 / 2), padded
    assert epochs[-1]["accuracy"] > 0.8 and epochs[-1]["loss"] < epochs[0]["loss"]


def test_without_set_epoch_every_epoch_repeats_the_first_order(full):
    run = launch("--epochs", 2, "--no-set-epoch")
    assert run.ok, run.error
    seen = orders(run)
    for rank in (0, 1):
        assert seen[rank][0] == seen[rank][1]
    assert seen[0][0] == orders(full[0])[0][0]     # epoch 1 is the same with or without it


def test_rank0_writes_the_checkpoint_once_per_epoch_and_a_crash_resumes_exactly(full,
                                                                             tmp_path):
    run, folder = full
    saved = metric(run, "saved")
    assert list(saved) == [0] and [e["epoch"] for e in saved[0]] == [1, 2, 3]
    state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert sorted(state) == ["epoch", "model", "optimizer"] and state["epoch"] == 3
    assert not any(key.startswith("module.") for key in state["model"])
    assert [p.name for p in folder.iterdir()] == ["checkpoint.pt"]    # no temporary file left

    crashed = launch("--epochs", 3, "--seed-per-rank", "--checkpoint-dir", tmp_path,
                     "--stop-after-epoch", 2)
    assert not crashed.ok and crashed.root_cause.exitcode == plain_ddp.STOP_EXIT_CODE
    assert len(crashed.events_of("epoch")) == 4                    # 2 epochs x 2 ranks
    # the switches a GPU needs for this (--deterministic) change no bit of a CPU run
    resumed = launch("--epochs", 3, "--checkpoint-dir", tmp_path, "--resume", "--deterministic")
    assert resumed.ok, resumed.error
    assert {r: [e["value"] for e in v] for r, v in metric(resumed, "deterministic").items()} == {
        0: [True], 1: [True]} and not metric(run, "deterministic")
    loaded = {rank: events[0] for rank, events in metric(resumed, "loaded").items()}
    assert sorted(loaded) == [0, 1] and {e["epoch"] for e in loaded.values()} == {2}
    assert all(e["devices"] == ["cpu"] for e in loaded.values())
    assert [e["epoch"] for e in resumed.events_of("epoch")] == [3, 3]   # only epoch 3 ran
    final = {rank: events[-1]["value"] for rank, events in metric(run, "checksum").items()}
    again = {rank: events[-1]["value"] for rank, events in metric(resumed, "checksum").items()}
    assert again == final                                          # bit for bit
    assert orders(resumed)[1][0] == orders(run)[1][2]              # epoch 3's order, again


def test_sections_shown_by_the_notebooks_exist():
    for name in ("setup", "data", "model", "resume", "loop", "step", "save", "load", "cleanup"):
        assert source("ddplab/workers/plain_ddp.py", name).strip()
    step = source("ddplab/workers/plain_ddp.py", "step")
    for plain in ("zero_grad()", "backward()", "step()"):
        assert plain in step
    for absent in ("autocast", "GradScaler", "no_sync"):
        assert absent not in source("ddplab/workers/plain_ddp.py")
    assert "torchrun --standalone --nproc-per-node 2 -m ddplab.workers.plain_ddp" in \
        plain_ddp.__doc__


def test_arguments():
    args = plain_ddp.parse_args([])
    assert (args.epochs, args.batch_size, args.dataset, args.resume, args.deterministic) == (
        3, 32, "digits", False, False)
    with pytest.raises(SystemExit):
        plain_ddp.parse_args(["--resume"])               # needs --checkpoint-dir


# ------------------------------------------------------------------ the baseline of lesson 01


def code_lines(text: str) -> list[str]:
    """The statements of a code section, comments and blank lines left out."""
    return [line.split("#")[0].strip() for line in text.splitlines()
            if line.split("#")[0].strip()]


def test_the_baseline_is_plain_ddp_without_the_distributed_lines():
    baseline = Path(ddplab.__file__).parent / "workers" / "single.py"
    text = baseline.read_text()
    for distributed in ("torch.distributed", "DistributedSampler", "DDP", "init_process_group"):
        assert distributed not in text.split('"""', 2)[2]       # not in the code
    assert code_lines(source("ddplab/workers/single.py", "step")) == \
        code_lines(source("ddplab/workers/plain_ddp.py", "step"))   # the very same loop
    run = ddplab.launch("ddplab.workers.single", 1, args=["--epochs", "2"], quiet=True,
                        live=False, timeout=300)
    epochs = run.check().events_of("epoch")
    assert [e["samples"] for e in epochs] == [1347, 1347]      # every sample, every epoch
    assert epochs[-1]["loss"] < epochs[0]["loss"] and epochs[-1]["accuracy"] > 0.8


def test_the_baseline_times_steps_one_by_one_with_and_without_sync():
    from ddplab import models
    from ddplab.workers import single

    torch.manual_seed(0)
    model = models.build_model("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = [(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))]
    for synced in (True, False):
        times, total = single.time_steps(model, loader, optimizer, torch.device("cpu"), 3,
                                         synced=synced)
        assert len(times) == 3 and all(t > 0 for t in times)
        assert total >= sum(times)            # the total spans every step's reading
    args = single.parse_args(["--time-steps", "4", "--no-sync"])
    assert (args.time_steps, args.no_sync) == (4, True)
    assert single.parse_args([]).time_steps == 0          # off unless asked for
