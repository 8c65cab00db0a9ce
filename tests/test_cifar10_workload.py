"""The `DDPLAB_WORKLOAD=cifar10` path on a small CIFAR-10 folder made here, nothing downloaded.

The folder is torchvision's real on-disk format (``cifar-10-batches-py``: five pickled training
batches, a test batch and ``batches.meta``), with a few images. torchvision checks every file
against the md5 of the real download; the fake folder's own md5s are declared in their place
(``CIFAR10.train_list``/``test_list``/``meta``, public class attributes). Everything after that
is torchvision's reading and ddplab's own code: the loader, the worker, the notebooks' DATA.
"""

from __future__ import annotations

import ast
import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from ddplab import data, launch

ROOT = Path(__file__).resolve().parent.parent
PER_BATCH, TEST = 64, 40          # 5 x 64 = 320 training images
CLASSES = [f"class{i}" for i in range(10)]


def make_cifar(root: Path) -> dict:
    """Write a CIFAR-10 folder under ``root``; return {file name: md5} of what was written."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = {f"data_batch_{i}": PER_BATCH for i in range(1, 6)} | {"test_batch": TEST}
    for name, count in files.items():
        images = rng.integers(0, 256, (count, 3 * 32 * 32), dtype=np.uint8)
        labels = [int(i % 10) for i in range(count)]
        (folder / name).write_bytes(pickle.dumps({"data": images, "labels": labels}))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": CLASSES}))
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def declared(md5: dict) -> dict:
    """The class attributes that name the files and their md5s, for this folder."""
    return {"train_list": [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)],
            "test_list": [["test_batch", md5["test_batch"]]],
            "meta": {"filename": "batches.meta", "key": "label_names",
                     "md5": md5["batches.meta"]}}


def notebook_data_args() -> list[str]:
    """The worker arguments notebook 03 uses with DDPLAB_WORKLOAD=cifar10 (its DATA)."""
    path = ROOT / "notebooks" / "03_ddp_spawn.ipynb"
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "DATA":
                return ast.literal_eval(node.value.value)["cifar10"]
    raise AssertionError(f"no DATA in {path}")


def test_the_loader_reads_the_folder_as_uint8_tensors_and_normalises_batches(tmp_path,
                                                                             monkeypatch):
    import torch
    import torchvision

    md5 = make_cifar(tmp_path)
    for name, value in declared(md5).items():
        monkeypatch.setattr(torchvision.datasets.CIFAR10, name, value)
    split = data.load_dataset("cifar10", root=str(tmp_path))
    assert (split.name, split.num_classes) == ("cifar10", 10)
    images, labels = split.train.tensors
    assert images.shape == (5 * PER_BATCH, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.tolist() == [i % 10 for i in range(PER_BATCH)] * 5
    assert split.test.tensors[0].shape == (TEST, 3, 32, 32)
    first = pickle.loads((tmp_path / "cifar-10-batches-py" / "data_batch_1").read_bytes())
    assert torch.equal(images[0], torch.from_numpy(first["data"][0]).view(3, 32, 32))
    batch = split.batch_transform(images[:8])
    assert batch.dtype == torch.float32 and batch.shape == (8, 3, 32, 32)
    mean = torch.tensor(data.CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(data.CIFAR10_STD).view(1, 3, 1, 1)
    assert torch.allclose(batch, (images[:8].float() / 255 - mean) / std, atol=1e-6)


def test_a_missing_folder_says_where_it_looked_and_how_to_fetch_it(tmp_path):
    with pytest.raises(data.DatasetNotFoundError) as caught:
        data.load_dataset("cifar10", root=str(tmp_path / "nowhere"))
    message = str(caught.value)
    assert str(tmp_path / "nowhere") in message
    assert "--data-root" in message and "--download" in message


@pytest.mark.slow
def test_the_training_worker_runs_the_cifar10_workload_on_two_ranks(tmp_path):
    """Notebook 03's DATA for cifar10 (ResNet-18, batch 128) through the real worker."""
    md5 = make_cifar(tmp_path / "data")
    script = tmp_path / "train_cifar.py"
    script.write_text(
        "import sys, torchvision\n"
        "from ddplab.workers import train\n"
        f"for name, value in {declared(md5)!r}.items():\n"
        "    setattr(torchvision.datasets.CIFAR10, name, value)\n"
        "train.main(sys.argv[1:])\n")
    args = [*notebook_data_args(), "--data-root", str(tmp_path / "data"), "--epochs", "1"]
    assert args[:2] == ["--dataset", "cifar10"]
    result = launch(str(script), 2, args=args, quiet=True, timeout=900)   # a safety net
    assert result.ok, result.error
    (summary,) = result.events_of("summary")
    assert (summary["dataset"], summary["model"], summary["batch_size"]) == (
        "cifar10", "resnet18", 128)
    assert summary["world_size"] == 2 and summary["epochs"] == 1
    assert summary["samples_seen_per_rank"] == [160, 160]   # 320 images, half to each rank
    assert len(set(summary["param_checksums_per_rank"])) == 1
