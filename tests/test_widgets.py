"""The lesson-04 sampler picture and its live explorer."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from ddplab.lab import widgets  # noqa: E402


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_picture_has_one_row_per_epoch_and_rank(drop_last):
    fig = widgets.sampler_picture(10, 3, 2, drop_last=drop_last)
    left, right = fig.axes
    assert len(left.get_yticks()) == 6
    assert "with" in left.get_title() and "without" in right.get_title()
    frames = [p for p in left.patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(frames) == (0 if drop_last else 2 * 2)  # 2 repeats per epoch, 2 epochs
    plt.close(fig)


def test_figure_png_renders_and_closes():
    fig = widgets.sampler_picture(5, 2, 1)
    data = widgets.figure_png(fig)
    assert data.startswith(b"\x89PNG") and not plt.fignum_exists(fig.number)


def test_explorer_redraws_when_a_control_changes():
    box = widgets.sampler_explorer()
    first = bytes(box.image.value)
    assert first.startswith(b"\x89PNG")
    box.controls["world_size"].value = 4
    assert bytes(box.image.value) != first
    second = bytes(box.image.value)
    box.controls["drop_last"].value = True
    assert bytes(box.image.value) != second
    assert set(box.controls) == {"world_size", "dataset_len", "epochs", "shuffle", "drop_last"}
