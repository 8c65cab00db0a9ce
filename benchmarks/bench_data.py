"""Data: how much of a training step waits for its batch, per loader.

Target: with the tensor-resident loader (``--loader tensor``, ``data.TensorLoader``) the time
spent waiting for data is at most 5% of step time. Beside it, on the same batches of indices:
the torchvision-style per-sample ``DataLoader`` (CIFAR-10's own ``__getitem__``: a uint8 HWC
array -> PIL image -> ``ToTensor`` -> ``Normalize``, then collated), and the plain per-sample
``DataLoader`` over the same tensors (``--loader dataloader``).

Every loader feeds ddplab's own training loop (``train.train_epoch``) on a CIFAR-shaped
workload (3x32x32, 10 classes, the small CNN, batch 32, 1 thread); the loader is wrapped so
the time spent in ``next(batch)`` is counted as waiting. One run is one epoch per loader, after
a warm-up epoch; loaders alternate. The same is measured on the course's default workload (the
8x8 digits), written to ``results/data_digits.json``.
Run: ``python benchmarks/bench_data.py [-n 5] [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from common import HERE, figure, interleaved, save, save_figure, summary
from ddplab import amp, data, models, train

TENSOR = "tensor loader (ddplab)"
TORCHVISION = "per-sample DataLoader, torchvision-style (PIL, ToTensor, Normalize)"
PER_SAMPLE = "per-sample DataLoader over tensors (--loader dataloader)"
TARGET = 0.05
BATCH = 32
DETAILS: list[dict[str, Any]] = []


class CifarLike(Dataset):
    """CIFAR-10's ``__getitem__`` over a uint8 ``(N, 32, 32, 3)`` array (no files needed).

    torchvision's ``CIFAR10`` keeps ``data`` as such an array and, per sample, builds a PIL
    image and runs the transform; this class does exactly that.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        from torchvision import transforms

        self.data, self.targets = images, labels.tolist()
        self.transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize(data.CIFAR10_MEAN, data.CIFAR10_STD)])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


class TimedLoader:
    """Wrap a loader and add up the seconds spent waiting for each batch."""

    def __init__(self, loader: data.Loader) -> None:
        self.loader, self.waited = loader, 0.0

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[data.Batch]:
        batches = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.waited += time.perf_counter() - start
            yield batch


def cifar_loaders(n: int, seed: int = 0) -> dict[str, data.Loader]:
    """The three loaders over the same CIFAR-shaped images and the same index batches."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    nchw = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    as_uint8 = TensorDataset(nchw, torch.from_numpy(labels))
    as_float = TensorDataset(data.normalize_uint8_images(nchw), torch.from_numpy(labels))
    return {
        TENSOR: data.make_loader(as_uint8, BATCH, seed=seed, kind="tensor",
                                 batch_transform=data.normalize_uint8_images),
        TORCHVISION: data.make_loader(CifarLike(images, labels), BATCH, seed=seed,
                                      kind="dataloader"),
        PER_SAMPLE: data.make_loader(as_float, BATCH, seed=seed, kind="dataloader"),
    }


def digits_loaders(seed: int = 0) -> dict[str, data.Loader]:
    """The course's default workload: the 8x8 digits, tensor loader and per-sample DataLoader."""
    train_set = data.digits().train
    return {
        TENSOR: data.make_loader(train_set, BATCH, seed=seed, kind="tensor"),
        PER_SAMPLE: data.make_loader(train_set, BATCH, seed=seed, kind="dataloader"),
    }


def epoch_runner(name: str, loader: data.Loader, in_channels: int) -> Callable[[], float]:
    """Return a function that trains one epoch from ``loader`` and returns its wait fraction."""
    torch.manual_seed(0)
    model = models.build_model("cnn", 10, in_channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = amp.make_grad_scaler("off", torch.device("cpu"))
    epoch = 0

    def run() -> float:
        nonlocal epoch
        timed = TimedLoader(loader)
        timed.set_epoch(epoch)
        start = time.perf_counter()
        _, steps, samples = train.train_epoch(
            model, timed, optimizer, scaler, device=torch.device("cpu"), amp_dtype=None,
            grad_accum=1, lr=0.01, warmup_steps=0, first_step=0, epoch=epoch, epochs=0,
            report=False)
        elapsed = time.perf_counter() - start
        epoch += 1
        DETAILS.append({"name": name, "wait_s": round(timed.waited, 4),
                        "step_ms": round(1000 * elapsed / steps, 3),
                        "samples_per_s": round(samples / elapsed, 1)})
        return timed.waited / elapsed

    return run


def measure(loaders: dict[str, data.Loader], in_channels: int, repeats: int, baseline: str
            ) -> dict[str, Any]:
    """Interleave one epoch per loader, ``repeats`` times; medians of the wait fractions."""
    runners = {name: epoch_runner(name, loader, in_channels) for name, loader in loaders.items()}
    for run in runners.values():
        run()  # warm-up epoch (first-call costs), not counted
    DETAILS.clear()
    result = summary(interleaved(runners, repeats), baseline=baseline)
    per_name = {name: [d for d in DETAILS if d["name"] == name] for name in runners}
    result.update(
        unit="fraction of step time", targets={TENSOR: {"limit": TARGET, "on": "value"}},
        step_ms={n: statistics.median(d["step_ms"] for d in ds) for n, ds in per_name.items()},
        samples_per_s={n: statistics.median(d["samples_per_s"] for d in ds)
                       for n, ds in per_name.items()},
        details=list(DETAILS), repeats=repeats,
    )
    waits = {n: result["medians"][n] * result["step_ms"][n] for n in runners}
    result["findings"] = ["Time waiting per batch: " + ", ".join(
        f"{n.split(' (')[0]} {ms:.2f} ms" for n, ms in waits.items()) + "."]
    if result["medians"][TENSOR] > TARGET:
        result["why"] = {TENSOR: "the tensor loader's index_select and per-batch work took more "
                                 "than 5% of a step; see the ms per step and the details."}
    return result


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--repeats", type=int, help="default: 5, or 3 with --quick")
    parser.add_argument("--quick", action="store_true", help="3 repeats, fewer images")
    parser.add_argument("--images", type=int, default=1024, help="CIFAR-shaped images per epoch")
    ns = parser.parse_args()
    repeats = ns.repeats or (3 if ns.quick else 5)
    images = 512 if ns.quick else ns.images
    torch.set_num_threads(1)  # as in every worker process of the course
    result = measure(cifar_loaders(images), 3, repeats, TORCHVISION)
    result["workload"] = (f"{images} random uint8 3x32x32 images per epoch, cnn, batch {BATCH}, "
                          "1 thread, 1 process; one epoch per loader per run")
    digits = measure(digits_loaders(), 1, repeats, PER_SAMPLE)
    digits.update(
        workload=f"the 8x8 digits (1347 training images), cnn, batch {BATCH}, 1 thread",
        title="Target 4, beside it: the course's default workload (digits)",
        description="The same measurement on the digits every notebook trains by default: a "
                    "step is about ten times shorter, so any per-batch cost weighs more.")
    for name, res in (("data", result), ("data_digits", digits)):
        path = save(name, res)
        plot(res, HERE / f"{name}.png")
        for loader in res["medians"]:
            print(f"{loader:70s} waits {100 * res['medians'][loader]:5.1f}% of "
                  f"{res['step_ms'][loader]:6.1f} ms/step")
        print(f"wrote {path}")
    return result


def plot(result: dict[str, Any], path: Any) -> None:
    """Stacked bars per loader: ms per step waiting for data and ms computing."""

    names = list(result["medians"])
    step = [result["step_ms"][n] for n in names]
    wait = [result["medians"][n] * s for n, s in zip(names, step)]
    fig, ax = figure(9, 0.5 * len(names) + 2.2)
    ys = range(len(names))
    ax.barh(ys, wait, color="#c44e52", label="waiting for data")
    ax.barh(ys, [s - w for s, w in zip(step, wait)], left=wait, color="#4c72b0",
            label="forward, backward, step")
    for y, name, s in zip(ys, names, step):
        ax.text(s, y, f"  {100 * result['medians'][name]:.1f}% waiting", va="center")
    ax.set_yticks(list(ys), [n.split(" (")[0] if len(n) > 40 else n for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step (median)")
    ax.set_xlim(0, max(step) * 1.6)
    ax.set_title(f"Where a step's time goes, per loader ({time.strftime('%Y-%m-%d')})\n"
                 f"{result['workload'].split(';')[0]}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
