"""Checkpoints: round trip, atomic write, prefix repair, map_location, corrupted files."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import zipfile
from pathlib import Path
from typing import Iterator
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from ddplab import checkpoint


def _trained_pair(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and an SGD optimizer with momentum buffers after one step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


_SAVED_ON: dict[str, str] = {}  # the device tag torch.save writes for CPU tensors, when set


def _tag(storage: object) -> "str | None":
    return _SAVED_ON.get("location") if getattr(storage, "device", None) == torch.device("cpu") \
        else None


def _untagged(storage: object, location: str) -> None:
    return None  # loading is left to torch's own deserializers


# torch.save asks the registered taggers, in order of priority, which device a storage is on
# (the CPU's tagger has priority 10): this one answers first, but only inside _saved_on().
torch.serialization.register_package(1, _tag, _untagged)


@contextlib.contextmanager
def _saved_on(location: str) -> Iterator[None]:
    """torch.save inside writes CPU tensors as if they lived on ``location`` (e.g. cuda:1)."""
    _SAVED_ON["location"] = location
    try:
        yield
    finally:
        _SAVED_ON.clear()


def test_round_trip_restores_model_optimizer_epoch_and_extra(tmp_path: Path) -> None:
    model, optimizer = _trained_pair(0)
    path = tmp_path / "ckpt" / "checkpoint.pt"
    checkpoint.save_checkpoint(path, model, optimizer, epoch=2, extra={"history": [{"loss": 1.5}]})
    fresh, fresh_opt = _trained_pair(1)
    state = checkpoint.load_checkpoint(path, fresh, fresh_opt, device="cpu")
    assert state == {"epoch": 2, "sampler_epoch": 2, "extra": {"history": [{"loss": 1.5}]}}
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    restored = [s["momentum_buffer"] for s in fresh_opt.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, restored, strict=True))


def test_rng_states_are_restored(tmp_path: Path) -> None:
    model, _ = _trained_pair()
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    checkpoint.save_checkpoint(tmp_path / "c.pt", model)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    checkpoint.load_checkpoint(tmp_path / "c.pt", model)
    assert torch.equal(torch.rand(3), expected[0])
    np.testing.assert_array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_wrapped_model_is_saved_without_prefix_and_loads_into_a_wrapper(tmp_path: Path) -> None:
    model, _ = _trained_pair()
    wrapped = nn.DataParallel(model)  # on a CPU-only machine this just holds the module
    checkpoint.save_checkpoint(tmp_path / "c.pt", wrapped)
    saved = torch.load(tmp_path / "c.pt", weights_only=True)["model"]
    assert not any(k.startswith("module.") for k in saved)
    target = nn.DataParallel(_trained_pair(5)[0])
    checkpoint.load_checkpoint(tmp_path / "c.pt", target)
    assert torch.equal(target.module[0].weight, model[0].weight)


def test_module_prefix_is_repaired_with_a_message(tmp_path: Path) -> None:
    model, _ = _trained_pair()
    torch.save(nn.DataParallel(model).state_dict(), tmp_path / "plain.pt")
    fresh = _trained_pair(7)[0]
    wrapped = torch.load(tmp_path / "plain.pt", weights_only=True)
    with pytest.raises(RuntimeError):  # the failure the lesson shows first
        fresh.load_state_dict(wrapped)
    keys = fresh.load_state_dict(wrapped, strict=False)  # why: every key has the prefix
    assert sorted(keys.unexpected_keys) == sorted(f"module.{k}" for k in model.state_dict())
    assert sorted(keys.missing_keys) == sorted(model.state_dict())
    with pytest.warns(UserWarning, match="module.state_dict"):
        checkpoint.load_checkpoint(tmp_path / "plain.pt", fresh)
    assert torch.equal(fresh[2].bias, model[2].bias)
    assert checkpoint.strip_module_prefix({"module.a": 1, "b": 2}) == {"a": 1, "b": 2}


def test_atomic_save_leaves_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    model, _ = _trained_pair()
    path = tmp_path / "c.pt"
    checkpoint.save_checkpoint(path, model, epoch=1)
    before = path.read_bytes()
    with mock.patch("torch.save", side_effect=OSError("disk full")):
        with pytest.raises(OSError, match="disk full"):
            checkpoint.save_checkpoint(path, model, epoch=2)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.pt"]  # no temporary file left behind


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_saved_file_gets_the_mode_the_umask_gives(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        checkpoint.atomic_save({"w": torch.ones(2)}, tmp_path / "c.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "c.pt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_killed_save_leaves_nothing_the_next_save_does_not_reclaim(tmp_path: Path) -> None:
    """A process killed (SIGKILL) while it writes: its temporary file goes at the next save."""
    def killed(obj, file):
        file.write(b"half a checkpoint")
        file.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    pid = os.fork()  # this process never touched CUDA: forking it is safe
    if pid == 0:
        try:
            with mock.patch("torch.save", killed):
                checkpoint.atomic_save({"w": torch.ones(2)}, tmp_path / "c.pt")
        finally:
            os._exit(1)  # only if the kill did not happen: the wait below then fails
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    left = os.listdir(tmp_path)  # killed: it had no chance to clean
    assert len(left) == 1 and left[0].startswith(".c.pt.tmp-"), left
    checkpoint.atomic_save({"w": torch.zeros(2)}, tmp_path / "c.pt")
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]
    assert torch.equal(torch.load(tmp_path / "c.pt")["w"], torch.zeros(2))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_damaged_file_raises_checkpoint_error(tmp_path: Path, damage: str) -> None:
    model, optimizer = _trained_pair()
    path = tmp_path / "c.pt"
    checkpoint.save_checkpoint(path, model, optimizer, epoch=1)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":  # inside the tensor bytes, which torch.load alone does not check
        with zipfile.ZipFile(path) as archive:
            info = next(i for i in archive.infolist() if "/data/" in i.filename)
        local = info.header_offset  # local header: 30 bytes, then name and extra field
        name_len = int.from_bytes(raw[local + 26:local + 28], "little")
        extra_len = int.from_bytes(raw[local + 28:local + 30], "little")
        raw[local + 30 + name_len + extra_len] ^= 0xFF
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = bytearray(b"not a checkpoint" * 64)
    path.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match="without --resume"):
        checkpoint.load_checkpoint(path, model, optimizer)


def test_pickled_module_is_refused_with_advice(tmp_path: Path) -> None:
    model, _ = _trained_pair()
    torch.save(model, tmp_path / "whole.pt")  # what one source does; unsafe to load
    with pytest.raises(checkpoint.CheckpointError, match="state_dict"):
        checkpoint.load_checkpoint(tmp_path / "whole.pt", model)


def test_missing_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--resume"):
        checkpoint.load_checkpoint(tmp_path / "nothing.pt", _trained_pair()[0])


def test_checkpoint_from_a_gpu_loads_onto_this_ranks_device(tmp_path: Path) -> None:
    model, optimizer = _trained_pair()
    path = tmp_path / "c.pt"
    with _saved_on("cuda:1"):
        checkpoint.save_checkpoint(path, model, optimizer, epoch=1)
    tags: list[str] = []
    torch.load(path, map_location=lambda storage, tag: tags.append(tag) or storage,
               weights_only=True)
    assert tags and set(tags) == {"cuda:1"}  # the file says its tensors came from cuda:1
    if not torch.cuda.is_available():  # without map_location torch tries to go back to cuda:1
        with pytest.raises(RuntimeError):
            torch.load(path, weights_only=True)
    fresh, fresh_opt = _trained_pair(3)
    checkpoint.load_checkpoint(path, fresh, fresh_opt, device="cpu")
    state = checkpoint.read_checkpoint(path, "cpu")
    assert {t.device.type for t in state["model"].values()} == {"cpu"}
    assert all(p.device.type == "cpu" for p in fresh.parameters())
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_map_location_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert checkpoint.map_location_for() == torch.device("cpu")
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert checkpoint.map_location_for() == torch.device("cuda", 1)
    assert checkpoint.map_location_for("cuda") == torch.device("cuda", 1)
    assert checkpoint.map_location_for(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert checkpoint.map_location_for("cpu") == torch.device("cpu")


def test_checkpoint_module_stays_self_contained() -> None:
    source = Path(checkpoint.__file__).read_text()
    imports = [line.split()[1] for line in source.splitlines()
               if line.startswith(("import ", "from "))]
    allowed = {"__future__", "os", "pickle", "random", "socket", "warnings", "zipfile",
               "typing", "torch", "torch.distributed"}
    assert set(imports) <= allowed, set(imports) - allowed
    assert "Example" in source or "::" in source.split('"""')[1]


def test_cuda_rng_state_of_this_gpu_is_saved_and_restored(tmp_path: Path) -> None:
    model, _ = _trained_pair()
    state = torch.arange(16, dtype=torch.uint8)
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.is_initialized", return_value=True), \
            mock.patch("torch.cuda.get_rng_state", return_value=state), \
            mock.patch("torch.cuda.set_rng_state") as set_state:
        checkpoint.save_checkpoint(tmp_path / "c.pt", model)
        checkpoint.load_checkpoint(tmp_path / "c.pt", model, device="cpu")
    (restored,), _ = set_state.call_args
    assert torch.equal(restored, state)


def _save_on_two_ranks(rank: int, init_file: str, folder: str) -> None:
    """One rank of a gloo job: save (rank 0 slowly), then check the file right away."""
    import json
    import time

    torch.set_num_threads(1)  # forked: the parent's OpenMP threads do not exist in this child
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2)
    writes = []
    real_save = checkpoint.atomic_save

    def slow_save(obj, path):  # a slow disk: rank 1 must wait at the barrier
        writes.append(path)
        time.sleep(1.0)
        real_save(obj, path)

    checkpoint.atomic_save = slow_save
    path = os.path.join(folder, "c.pt")
    model, optimizer = _trained_pair()
    checkpoint.save_checkpoint(path, model, optimizer, epoch=1)
    found = os.path.exists(path)  # right after save_checkpoint returns, on every rank
    torch.distributed.destroy_process_group()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as file:
        json.dump({"writes": len(writes), "found": found}, file)


@pytest.mark.slow
def test_only_rank0_writes_and_every_rank_finds_the_file(tmp_path: Path) -> None:
    import json

    # Forked from this process, which never touched CUDA: no rank imports torch again.
    torch.multiprocessing.start_processes(
        _save_on_two_ranks, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
        start_method="fork")
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [f["writes"] for f in facts] == [1, 0]
    assert all(f["found"] for f in facts)


def _rng_on_two_ranks(rank: int, init_file: str, folder: str) -> None:
    """One rank of a gloo job: save RNG streams per rank, reseed, load; report what it drew."""
    import json
    import warnings

    torch.set_num_threads(1)  # forked: the parent's OpenMP threads do not exist in this child
    model, _ = _trained_pair()
    one = os.path.join(folder, "one.pt")
    if rank == 0:  # a world of one saved this file: it holds rank 0's states only
        checkpoint.save_checkpoint(one, model)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2)
    torch.manual_seed(100 + rank)  # each rank's own stream, mid-run
    random.seed(200 + rank)
    path = os.path.join(folder, "c.pt")
    checkpoint.save_checkpoint(path, model)
    expected = torch.rand(3).tolist(), random.random()  # this rank's next draws
    torch.manual_seed(0)
    random.seed(0)
    checkpoint.load_checkpoint(path, model, device="cpu")
    got = torch.rand(3).tolist(), random.random()
    torch.manual_seed(7)
    kept = torch.rand(3).tolist()
    torch.manual_seed(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load_checkpoint(one, model, device="cpu")
    after_one = torch.rand(3).tolist()
    torch.distributed.destroy_process_group()
    with open(os.path.join(folder, f"rng{rank}.json"), "w") as file:
        json.dump({"expected": expected, "got": got, "kept": after_one == kept,
                   "warned": any("rank 1" in str(w.message) for w in caught)}, file)


@pytest.mark.slow
def test_each_rank_restores_its_own_rng_states(tmp_path: Path) -> None:
    import json

    torch.multiprocessing.start_processes(
        _rng_on_two_ranks, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
        start_method="fork")
    facts = [json.loads((tmp_path / f"rng{r}.json").read_text()) for r in range(2)]
    assert facts[0]["expected"] != facts[1]["expected"]  # two different streams were saved
    assert [f["got"] for f in facts] == [f["expected"] for f in facts]  # rank 1 gets rank 1's
    saved = torch.load(tmp_path / "c.pt", weights_only=True)["rng"]
    assert sorted(saved) == [0, 1]
    # a file saved by one process: rank 0 restores, rank 1 keeps its own stream and warns
    assert [f["kept"] for f in facts] == [False, True]
    assert [f["warned"] for f in facts] == [False, True]


def test_corrupted_file_message_cuts_the_cause_at_a_sentence_end(tmp_path: Path) -> None:
    model, _ = _trained_pair()
    checkpoint.save_checkpoint(tmp_path / "c.pt", model)
    long = "The archive is damaged here. " + "It goes on and on, quoting " * 10
    with mock.patch("torch.load", side_effect=RuntimeError(long)), \
            pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.read_checkpoint(tmp_path / "c.pt", "cpu")
    assert "(RuntimeError: The archive is damaged here.)" in str(caught.value)
    unbroken = "x" * 50 + " word" * 40  # no sentence end: cut between words
    with mock.patch("torch.load", side_effect=RuntimeError(unbroken)), \
            pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.read_checkpoint(tmp_path / "c.pt", "cpu")
    assert " word ...)" in str(caught.value)   # cut between two words, not inside one
