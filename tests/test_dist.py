"""Device and backend decisions of ddplab.dist, with CUDA patched in to look like GPUs."""

from unittest import mock

import pytest
import torch

from ddplab import dist as ddist


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
