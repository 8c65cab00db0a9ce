"""The notebook figures and tables draw what they are given; results survive between notebooks."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from ddplab.lab import plots  # noqa: E402

HISTORY = [{"epoch": e, "loss": 1.0 / e, "accuracy": 0.5 + 0.1 * e, "epoch_time": t}
           for e, t in zip(range(1, 5), (3.0, 1.0, 1.2, 0.8))]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_table_aligns_columns_and_formats_floats(capsys):
    text = plots.table([{"run": "single", "accuracy": 0.93456}, {"run": "ddp x2", "time": 1.5}],
                       title="runs")
    lines = text.splitlines()
    assert lines[0] == "runs" and lines[1].split() == ["run", "accuracy", "time"]
    assert "0.9346" in text and lines[3].index("0.9346") == lines[1].index("accuracy")
    assert capsys.readouterr().out.strip() == text
    assert text._ipython_display_() is None   # a cell ending in table(...) shows it once
    assert plots.table([{"a": 1}], quiet=True) and capsys.readouterr().out == ""


def test_curves_draws_loss_and_accuracy_for_each_run():
    fig = plots.curves({"a": HISTORY, "b": HISTORY[:2]}, title="t")
    loss, accuracy = fig.axes
    assert len(loss.lines) == 2 and list(accuracy.lines[1].get_ydata()) == [0.6, 0.7]


def test_epoch_times_marks_warmup_and_median():
    fig = plots.epoch_times(HISTORY, warmup=1)
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == [3.0, 1.0, 1.2, 0.8]
    assert ax.lines[0].get_ydata()[0] == pytest.approx(1.0)   # median of 1.0, 1.2, 0.8
    assert "median of 3" in ax.get_legend().get_texts()[0].get_text()


def test_bars_and_grouped_bars():
    fig = plots.bars({"single": 1.0, "dp": 1.4}, "s", reference=1.0, reference_label="base")
    assert [p.get_height() for p in fig.axes[0].patches] == [1.0, 1.4]
    fig = plots.grouped_bars({"source": {"1 GPU": 13.2, "DP": 19.1}, "here": {"1 GPU": 2.0}},
                             "s")
    assert len(fig.axes[0].patches) == 3
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1 GPU", "DP"]


def test_share_grid_draws_a_labelled_grid_per_panel():
    fig = plots.share_grid({"ddp": [[1.0, 1.0], [1.0, 1.0]], "zero3": [[0.5, 0.25], [0.5, 0.75]]},
                           rows=["rank 0", "rank 1"], columns=["weights", "Adam state"],
                           title="shares")
    ddp, zero3 = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["ddp", "zero3"]
    assert [t.get_text() for t in zero3.texts] == ["50%", "25%", "50%", "75%"]
    assert [t.get_text() for t in ddp.get_yticklabels()] == ["rank 0", "rank 1"]
    assert [t.get_text() for t in zero3.get_xticklabels()] == ["weights", "Adam state"]
    shade = zero3.images[0].get_array()
    assert shade[1][1] == 0.75 and shade[0][1] == 0.25          # shaded by the share it shows


def test_results_round_trip_and_missing_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAB_RESULTS", str(tmp_path / "results"))
    assert plots.load_result("01_baseline") is None
    path = plots.save_result("01_baseline", {"accuracy": 0.95, "hardware": "CPU"})
    assert path.parent == tmp_path / "results"
    assert plots.load_result("01_baseline") == {"accuracy": 0.95, "hardware": "CPU"}
    path.write_text("{broken")
    assert plots.load_result("01_baseline") is None
