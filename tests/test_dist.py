"""ddplab.dist: device and backend decisions (CUDA patched in to look like GPUs), collectives."""

import contextlib
import io
import json
import os
from unittest import mock

import pytest
import torch

from ddplab import dist as ddist
from ddplab import events


def gpus(count: int):
    return mock.patch.multiple(torch.cuda, is_available=mock.Mock(return_value=count > 0),
                               device_count=mock.Mock(return_value=count))


def test_backend_is_gloo_without_gpus_and_nccl_with(monkeypatch):
    monkeypatch.delenv("DDPLAB_BACKEND", raising=False)
    with gpus(0):
        assert ddist.pick_backend() == "gloo"
        with pytest.raises(RuntimeError, match="use backend='gloo'"):
            ddist.pick_backend("nccl")
    with gpus(4):
        assert ddist.pick_backend() == "nccl"
        assert ddist.pick_backend("gloo") == "gloo"


def test_more_local_processes_than_gpus_fall_back_to_gloo(monkeypatch):
    monkeypatch.delenv("DDPLAB_BACKEND", raising=False)
    with gpus(1):
        assert ddist.pick_backend(local_world_size=2) == "gloo"
        assert ddist.pick_backend(local_world_size=1) == "nccl"
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert ddist.pick_backend() == "gloo"


def test_launcher_choice_reaches_the_worker(monkeypatch):
    monkeypatch.setenv("DDPLAB_BACKEND", "gloo")
    with gpus(2):
        assert ddist.pick_backend() == "gloo"


def test_device_follows_local_rank_on_gpus():
    with gpus(2):
        assert ddist.pick_device(1, "nccl") == torch.device("cuda", 1)
        with pytest.raises(RuntimeError, match="--nproc-per-node 2"):
            ddist.pick_device(2, "nccl")
    assert ddist.pick_device(5, "gloo") == torch.device("cpu")


def test_device_ids_only_on_cuda():
    cpu = ddist.DistInfo(0, 0, 2, torch.device("cpu"), "gloo")
    gpu = ddist.DistInfo(3, 1, 4, torch.device("cuda", 1), "nccl")
    assert cpu.device_ids is None and gpu.device_ids == [1]
    assert cpu.is_main and not gpu.is_main


def test_single_process_setup_needs_no_process_group(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DDPLAB_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    with gpus(0):
        info = ddist.setup()
    assert (info.rank, info.world_size, info.backend) == (0, 1, "gloo")
    assert not torch.distributed.is_initialized()
    assert ddist.get_world_size() == 1 and ddist.all_reduce_mean(2.5) == 2.5
    ddist.cleanup()


def test_setup_returns_only_once_every_rank_has_joined(monkeypatch):
    """A rank of a job that does no collective (an exercise skeleton) could finish and exit while
    a slower peer was still connecting to it: under load, 1 launch in about 100 failed in gloo's
    connect. setup asks torch for its store barrier at the end of init; a user's own choice wins."""
    seen = []
    monkeypatch.setattr(ddist.dist, "init_process_group",
                        lambda *a, **k: seen.append(os.environ.get("TORCH_DIST_INIT_BARRIER")))
    monkeypatch.setattr(ddist.dist, "is_initialized", lambda: False)
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"),
                        ("DDPLAB_BACKEND", "gloo")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCH_DIST_INIT_BARRIER", raising=False)
    with gpus(0):
        ddist.setup()
        monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "0")
        ddist.setup()
    assert seen == ["1", "0"]


def test_print0_prints_on_rank0_only(capsys, monkeypatch):
    ddist.print0("hello")
    assert capsys.readouterr().out == "hello\n"
    monkeypatch.setattr(ddist, "get_rank", lambda: 1)
    ddist.print0("hello")
    assert capsys.readouterr().out == ""


def test_prefixed_stream_writes_whole_lines():
    import io

    raw = io.StringIO()
    stream = ddist._Prefixed(raw, "[rank1] ")
    stream.write("a")
    assert raw.getvalue() == ""
    stream.write("b\nc\n")
    assert raw.getvalue() == "[rank1] ab\n[rank1] c\n"


def test_collectives_in_a_world_of_one_return_the_value(monkeypatch):
    monkeypatch.setattr(ddist, "get_world_size", lambda: 1)
    tensor = torch.tensor([1.0, 2.0])
    assert ddist.all_reduce_sum(tensor) is tensor and tensor.tolist() == [1.0, 2.0]
    assert ddist.all_gather_floats(3) == [3.0]
    assert ddist.all_reduce_mean(2.5) == 2.5


def _collectives(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # forked: the parent's OpenMP threads do not exist in this child
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # as mp.spawn starts a rank
        os.environ.pop(name, None)
    ddist.setup("gloo", rank=rank, world_size=world_size, init_method=f"file://{init_file}")
    try:
        with contextlib.redirect_stdout(io.StringIO()) as said:
            events.emit("hello")  # reads RANK, which setup set for an mp.spawn rank
        facts = {
            "event_rank": events.parse(said.getvalue().strip())["rank"],
            "sum": ddist.all_reduce_sum(torch.tensor([rank + 1.0, 1.0])).tolist(),
            "mean": ddist.all_reduce_mean(rank * 2.0),
            "gathered": ddist.all_gather_floats(rank * 10.0 + 0.5),
        }
    finally:
        ddist.cleanup()
    with open(f"{out_dir}/{rank}.json", "w") as file:
        json.dump(facts, file)


@pytest.mark.slow
def test_collectives_on_three_gloo_processes(tmp_path):
    # Forked from this process, which never touched CUDA: no rank imports torch again.
    torch.multiprocessing.start_processes(
        _collectives, args=(3, str(tmp_path / "init"), str(tmp_path)), nprocs=3,
        start_method="fork")
    facts = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    for fact in facts:  # every rank gets the same answer
        assert fact["sum"] == [1.0 + 2.0 + 3.0, 3.0]
        assert fact["mean"] == pytest.approx((0 + 2 + 4) / 3)
        assert fact["gathered"] == [0.5, 10.5, 20.5]  # in rank order
    assert [fact["event_rank"] for fact in facts] == [0, 1, 2]
