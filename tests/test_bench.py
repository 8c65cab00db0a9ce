"""The measurements of notebook 09 and `python -m ddplab bench`: tiny runs, no timing asserts."""

from __future__ import annotations

import json
import math

import pytest

from ddplab.lab import bench


def test_plan_has_the_source_rows_and_reuses_ddp_x2_when_n_is_2():
    setups = bench.plan(gpus=0, cpus=2)
    assert [s.name for s in setups] == list(bench.SOURCE_SECONDS)
    by = {s.name: s for s in setups}
    assert by["DDP xN"].same_as == "DDP x2" and by["DDP xN + AMP"].amp == "bf16"
    assert by["DDP xN + AMP"].repeats == 1 and by["single"].repeats is None   # bf16 emulated
    gpu = {s.name: s for s in bench.plan(gpus=8)}
    assert gpu["DDP xN"].nprocs == 8 and gpu["DDP xN"].same_as is None
    assert gpu["DataParallel"].devices == 8 and gpu["DDP xN + AMP"].amp == "fp16"
    assert gpu["DDP xN + AMP"].repeats is None


def test_batch_runs_use_processes_then_accumulation():
    assert bench.batch_runs([16, 32, 128], 16, max_procs=2) == [(16, 1, 1), (32, 2, 1),
                                                                 (128, 2, 4)]
    with pytest.raises(ValueError, match="multiple"):
        bench.batch_runs([24], 16)


def test_traffic_model_ring_is_bounded_and_the_server_grows():
    model = bench.traffic_model([2, 4, 64], message_bytes=1.0)
    assert [m["server"] for m in model] == [2.0, 6.0, 126.0]
    assert all(m["ring"] < 4.0 for m in model) and model[0]["ring"] == 2.0


def _row(name, nprocs, samples_per_s, same_as=None, rates=None, mode="ddp"):
    setup = bench.Setup(name, nprocs, mode, nprocs, same_as=same_as)
    rates = [samples_per_s] * 3 if rates is None else rates
    return bench.Row(setup=setup, samples_per_s=samples_per_s, epoch_time=1.0, accuracy=0.9,
                     global_batch=64 * nprocs, samples_per_epoch=1347, checksums_equal=True,
                     status="ok", wall_time=2.0, speedup=samples_per_s / 100.0, rates=rates)


def test_markdown_table_puts_the_source_beside_ours():
    rows = [_row("single", 1, 100.0), _row("DDP x2", 2, 150.0),
            _row("DDP xN", 2, 150.0, same_as="DDP x2")]
    table = bench.markdown_table(rows)
    assert "| single | 1 |" in table and "13.2" in table and "9.8" in table
    assert "| 1.50 |" in table and "| reference |" in table
    assert "| 2 | 75% |" in table and "| 1 | 100% |" in table     # speed-up over devices
    assert table.count("| faster vs single |") == 1          # DDP x2's, measured
    xn = next(line for line in table.splitlines() if line.startswith("| DDP xN |"))
    assert "n/a on this machine" in xn and "the DDP x2 row" in xn and "| 4 | 6.1 |" in xn
    assert "1.50" not in xn                                   # no number of ours beside 4 GPUs


def test_a_busy_machine_is_said_in_every_verdict_and_the_notes():
    rows = [_row("single", 1, 100.0), _row("DataParallel", 1, 100.0, mode="dp"),
            _row("DDP x2", 2, 150.0)]
    for row in rows:
        row.epoch_times = [1.0, 1.01, 1.02]
    assert not bench.busy_machine(rows)["busy"]               # no load known: not called busy
    for row in rows:
        row.loads = (0.2, 1.9)                                # our 2 processes, nothing else
    assert not bench.busy_machine(rows, cores=2)["busy"]
    assert "machine busy" not in bench.table_notes(rows)
    rows[0].loads = (3.5, 3.0)                                # other work on both cores
    assert bench.busy_machine(rows, cores=2) == {
        "before": 3.5, "after": 1.9, "others": 3.5, "cores": 2, "busy": True}
    rows[0].loads, rows[-1].loads = (0.2, 1.0), (1.0, 4.5)    # came during the table
    assert bench.busy_machine(rows, cores=2)["others"] == 2.5
    table = bench.markdown_table(rows)
    assert "| reference |" in table and table.count("machine busy: re-run") == 2
    assert "| 1.00 | reference | 1 | 100% |" in table                 # the single run's own
    assert table.count("| busy | machine busy: re-run |") == 2        # no speed-up of ours,
    assert table.count("| 1 | busy |") == 1 and "| 2 | busy |" in table   # no efficiency
    assert "1.50" not in table and "75%" not in table
    notes = bench.table_notes(rows, predicted=1.4, gpus=0)
    assert "machine busy" in notes and "you predicted 1.4x: compare after a re-run" in notes
    assert "DDP x2: measured 1.50x, unreliable: machine busy;" in notes   # the ratio, flagged
    assert "right" not in notes and "off by" not in notes                 # no prediction judged
    assert "2.5 cores' worth of work" in notes and "re-run" in notes
    amp = _row("DDP xN + AMP", 2, 300.0)                      # 3.00x on 2 processes
    amp.setup.amp = "bf16"
    busy = bench.table_notes([*rows, amp])
    assert len(busy.splitlines()) == 2                        # the prediction, then busy: no rows
    assert "DDP xN + AMP" not in busy and "DataParallel" not in busy
    for row in rows:
        row.loads = (0.2, 1.9)                                # quiet: the reading is given
    quiet = bench.table_notes([*rows, amp])
    assert "autocast's bf16 compute here, not scaling" in quiet and "machine busy" not in quiet
    assert "DataParallel (the single run's work, on one device): 1.00x" in quiet


def test_the_loader_comparison_reads_rates_as_fit_epoch_reports_them():
    class Launch:
        def events_of(self, kind):
            return [{"epoch": e, "rank": r, "samples": 674, "epoch_time": t + r,
                     "accuracy": 0.9} for e, t in ((1, 9.0), (2, 1.0), (3, 2.0)) for r in (0, 1)]
    plain = bench.launch_rates(Launch())
    assert plain == {"rates": [1348.0, 674.0], "samples_per_epoch": 1348, "accuracy": 0.9,
                     "epochs": 3}
    text = bench.loader_text(plain, _row("DDP x2", 2, 2022.0), pinned=True)
    assert "2.00x" in text and "pinned" in text and "after 3 epochs" in text
    busy = bench.loader_text(plain, _row("DDP x2", 2, 2022.0), busy=True)
    assert "2.00x, machine busy: re-run" in busy and "faster" not in busy


def test_the_cpu_text_lists_the_bf16_instructions(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("flags : fpu avx512f avx512_bf16\n")
    assert "listed by the CPU: avx512_bf16" in bench.cpu_bf16_text(info)
    info.write_text("flags : fpu avx2\n")
    assert "listed by the CPU: none" in bench.cpu_bf16_text(info)
    assert "listed by the CPU: unknown" in bench.cpu_bf16_text(tmp_path / "absent")


def test_verdict_calls_a_difference_only_beyond_both_spreads_and_the_noise():
    assert bench.verdict([150, 160, 170], [100, 105, 110]) == "faster"
    assert bench.verdict([60, 70, 80], [100, 105, 110]) == "slower"
    assert bench.verdict([90, 130, 170], [100, 105, 110]) == "no clear difference"  # overlap
    assert bench.verdict([112, 113, 114], [105, 106, 107]) == "no clear difference"  # < 10%
    assert bench.verdict([], [100]) == "n/a"


def test_row_verdict_compares_amp_with_its_own_run_and_marks_one_epoch():
    rows = [_row("single", 1, 100.0, rates=[95, 100, 105]),
            _row("DDP xN", 2, 150.0, rates=[140, 150, 160]),
            _row("DDP xN + AMP", 2, 212.0, rates=[212])]
    assert bench.row_verdict(rows[0], rows) == "reference"
    assert bench.row_verdict(rows[1], rows) == "faster vs single"
    assert bench.row_verdict(rows[2], rows) == "faster vs DDP xN; 1 epoch, no spread"
    rows[2].rates = [150.0]
    assert bench.row_verdict(rows[2], rows) == "no clear difference vs DDP xN; 1 epoch, no spread"


def test_row_verdict_judges_dataparallel_on_one_device_by_its_fastest_epochs():
    single = _row("single", 1, 100.0, rates=[95, 100, 105])
    single.epoch_times = [1.00, 1.02, 1.05]
    dp = _row("DataParallel", 1, 76.0, rates=[60, 76, 80])
    dp.setup = bench.Setup("DataParallel", 1, "dp", 1)
    dp.epoch_times = [1.01, 1.20, 1.60]          # median much slower, but a busy machine
    rows = [single, dp]
    assert bench.verdict(dp.rates, single.rates) == "slower"
    assert bench.row_verdict(dp, rows) == "too noisy to compare vs single (fastest epochs, " \
                                          "one device)"
    dp.epoch_times = [1.03, 1.04, 1.06]
    assert bench.row_verdict(dp, rows).startswith("within noise vs single")
    dp.epoch_times = [1.30, 1.31, 1.35]
    assert bench.row_verdict(dp, rows).startswith("slower vs single")
    dp.setup = bench.Setup("DataParallel", 1, "dp", 2)   # two GPUs: the median rule
    assert bench.row_verdict(dp, rows) == "slower vs single"


def test_fastest_epochs_says_within_noise_only_when_the_spreads_allow_it():
    steady = bench.fastest_epochs([1.00, 1.02, 1.05], [1.01, 1.03, 1.04])
    assert steady["reading"] == "within noise" and steady["ratio"] == pytest.approx(1.01)
    apart = bench.fastest_epochs([1.00, 1.02, 1.05], [1.30, 1.31, 1.35])
    assert apart["reading"] == "a difference" and apart["ratio"] == pytest.approx(1.3)
    busy = bench.fastest_epochs([0.28, 0.40, 0.51], [0.29, 0.30, 0.31])
    assert busy["reading"] == "busy" and busy["widths"][0] == pytest.approx(0.51 / 0.28 - 1)


def lines_by_label(figure) -> dict[str, tuple[list[float], list[float]]]:
    (ax,) = figure.axes
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines()}


def test_speedup_plot_shows_ours_the_source_and_the_ideal_line():
    rows = [_row("single", 1, 100.0), _row("DDP x2", 2, 150.0),
            _row("DataParallel", 2, 120.0)]
    figure = bench.plot_speedup(rows)
    lines = lines_by_label(figure)
    most = max(devices for devices, _ in bench.SOURCE_SECONDS.values())   # 4 GPUs in the source
    assert lines["ideal: speed-up = devices"] == ([1, most], [1, most])
    assert lines["ours: single, DDP"] == ([1, 2], [1.0, 1.5])               # from the rows
    assert lines["ours: DataParallel"] == ([2], [1.2])
    single = bench.SOURCE_SECONDS["single"][1]
    x, y = lines[f"{bench.SOURCE_LABEL}: single, DDP"]
    assert x == [1, 2, 4] and y == pytest.approx([1.0, single / 9.8, single / 6.1])
    assert lines[f"{bench.SOURCE_LABEL}: DDP + AMP"] == ([4], [pytest.approx(single / 6.5)])
    assert "ours: DDP + AMP" not in lines                                    # no such row of ours
    (ax,) = figure.axes
    assert ax.get_xlabel().startswith("devices") and ax.get_ylabel().startswith("speed-up")
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(legend) == set(lines)


def test_the_source_hardware_is_not_invented():
    """The source's table never names its GPUs: the text and the plot say "the source's GPUs"."""
    import re

    rows = [_row("single", 1, 100.0), _row("DDP x2", 2, 150.0)]
    legend = [t.get_text() for t in bench.plot_speedup(rows).axes[0].get_legend().get_texts()]
    source_lines = [text for text in legend if text.startswith(bench.SOURCE_LABEL)]
    assert source_lines and "the source's GPUs" in bench.SOURCE_HARDWARE
    gpu_model = re.compile(r"\b(A|H|V|P|T)\d{2,3}\b|RTX|Tesla")
    assert not any(gpu_model.search(text) for text in [*legend, bench.SOURCE_HARDWARE])


@pytest.mark.slow
def test_a_tiny_scaling_table_measures_two_setups():
    setups = [bench.Setup("single", 1, "single", 1), bench.Setup("DDP x2", 2, "ddp", 2)]
    rows = bench.scaling_table("digits", repeats=1, batch_size=128, setups=setups)
    assert [r.status for r in rows] == ["ok", "ok"]
    for row in rows:
        assert row.samples_per_s > 0 and math.isfinite(row.samples_per_s)
        assert len(row.epoch_times) == len(row.rates) == 1 and row.checksums_equal
    assert rows[0].speedup == 1.0
    assert rows[1].global_batch == 2 * rows[0].global_batch
    assert abs(rows[1].samples_per_epoch - rows[0].samples_per_epoch) <= 1


@pytest.mark.slow
def test_cli_writes_the_report_and_plots(tmp_path):
    code = bench.main(["--", "--skip-scaling", "--global-batches", "16", "--out", str(tmp_path)])
    assert code == 0
    report = (tmp_path / "bench.md").read_text()
    assert "Accuracy against global batch" in report and "| same lr | 16 |" in report
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["policy"] for r in results["accuracy"]} == set(bench.POLICIES)
    assert all(r["status"] == "ok" for r in results["accuracy"])
    assert all(len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
               for r in results["accuracy"])   # the training loss of each of the 2 epochs


@pytest.mark.slow
def test_bandwidth_rows_are_positive_for_every_size():
    rows = bench.bandwidth(2, max_bytes=1 << 12, repeats=1)
    assert {r["algorithm"] for r in rows} == {"all_reduce", "ring"}
    assert all(r["busbw"] > 0 and math.isfinite(r["busbw"]) for r in rows)


def test_bandwidth_plot_has_one_line_per_algorithm_in_mb_per_s_by_size():
    rows = [{"algorithm": algorithm, "bytes": size, "busbw": busbw}
            for algorithm, scale in (("all_reduce", 2e6), ("ring", 1e6))
            for size, busbw in ((4096, 4 * scale), (1024, scale))]       # unsorted on purpose
    figure = bench.plot_bandwidth(rows)
    lines = lines_by_label(figure)
    assert lines == {"dist.all_reduce (library)": ([1024, 4096], [2.0, 8.0]),
                     "ring from scratch": ([1024, 4096], [1.0, 4.0])}
    (ax,) = figure.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "bytes" in ax.get_xlabel() and "MB/s" in ax.get_ylabel()


def test_backward_overlap_times_all_reduces_from_backwards_first_gradient(tmp_path):
    ops = [{"ph": "X", "name": "forward", "ts": 0, "dur": 900, "tid": 1},
           {"ph": "X", "name": bench.GRADIENT_OP + ": AddmmBackward0", "ts": 1000, "dur": 2000,
            "tid": 1},
           {"ph": "X", "name": bench.GRADIENT_OP + ": GeluBackward0", "ts": 3000, "dur": 3000,
            "tid": 1},
           {"ph": "X", "name": bench.ALL_REDUCE_OP, "ts": 7000, "dur": 500, "tid": 9},
           {"ph": "X", "name": bench.ALL_REDUCE_OP, "ts": 2500, "dur": 1000, "tid": 8},
           {"ph": "X", "name": bench.ALL_REDUCE_OP, "ts": 3000, "dur": 2500, "tid": 9},
           {"ph": "X", "name": "backward", "ts": 950, "dur": 7000, "tid": 1},
           {"ph": "i", "name": bench.ALL_REDUCE_OP, "ts": 0, "tid": 8}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": ops}))
    seen = bench.backward_overlap(trace)
    # unions: 1.5-2.5 and 2.0-4.5 overlap (3.0 ms), before the last gradient at 5.0 ms; then
    # 6.0-6.5 after it (3.5 ms in all); backward's span ends at 7.95 - 1.0 ms
    assert seen == {"gradients_ms": 5.0, "backward_ms": 6.95, "launches_ms": [],
                    "computing": [(0.0, 5.0)],
                    "all_reduces": [(1.5, 2.5, 8), (2.0, 4.5, 9), (6.0, 6.5, 9)],
                    "overlapped": 2, "busy_ms": 3.5, "hidden_ms": 3.0}
    trace.write_text(json.dumps({"traceEvents": ops[:2]}))
    assert bench.backward_overlap(trace)["backward_ms"] is None
    trace.write_text(json.dumps({"traceEvents": ops[:1]}))
    with pytest.raises(ValueError, match="no backward"):
        bench.backward_overlap(trace)


def test_backward_overlap_ends_the_gradients_where_the_last_all_reduce_is_launched(tmp_path):
    # The last AccumulateGrad's hook launches the last bucket's all-reduce (c10d::allreduce_) and
    # sits in the launch while gloo's thread runs it: computing stops at the launch.
    grad = bench.GRADIENT_OP + ": torch::autograd::AccumulateGrad"
    ops = [{"ph": "X", "name": bench.GRADIENT_OP + ": AddmmBackward0", "ts": 1000, "dur": 4000,
            "tid": 1},
           {"ph": "X", "name": grad, "ts": 5000, "dur": 3000, "tid": 1},
           {"ph": "X", "name": "torch::distributed::reducer::mul_out", "ts": 5000, "dur": 200,
            "tid": 1},
           {"ph": "X", "name": "c10d::allreduce_", "ts": 5200, "dur": 2700, "tid": 1},
           {"ph": "X", "name": "c10d::allreduce_", "ts": 5300, "dur": 100, "tid": 2},   # not its own
           {"ph": "X", "name": bench.ALL_REDUCE_OP, "ts": 4000, "dur": 500, "tid": 9},
           {"ph": "X", "name": bench.ALL_REDUCE_OP, "ts": 6000, "dur": 3000, "tid": 9},
           {"ph": "X", "name": "backward", "ts": 900, "dur": 8500, "tid": 1}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": ops}))
    seen = bench.backward_overlap(trace)
    assert seen["gradients_ms"] == 4.2 and seen["backward_ms"] == 8.4
    assert seen["launches_ms"] == [4.2]        # the other thread's launch is not backward's
    assert seen["overlapped"] == 1 and seen["busy_ms"] == 3.5
    assert seen["hidden_ms"] == 0.5            # the first all-reduce; none of the last one
    assert seen["computing"] == [(0.0, 4.2)]
    # a launch inside an earlier gradient op: the op's time after its launch is not computing
    ops[0]["dur"] = 3000
    ops.append({"ph": "X", "name": "c10d::allreduce_", "ts": 3800, "dur": 1200, "tid": 1})
    trace.write_text(json.dumps({"traceEvents": ops}))
    seen = bench.backward_overlap(trace)
    assert seen["gradients_ms"] == 4.2 and seen["hidden_ms"] == 0.0
    assert seen["launches_ms"] == [2.8, 4.2]   # one bucket handed over before the last gradient
    assert seen["computing"] == [(0.0, 2.8), (4.0, 4.2)]   # not while it handed the bucket over


def test_the_cli_sweeps_the_batches_notebook_09_sweeps():
    import ast
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[1] / "notebooks" / "09_scaling_benchmark.ipynb")
                    .read_text())
    first = "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])
    tree = ast.parse(first.replace("%", "#"))
    node = next(n.value for n in tree.body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ACCURACY")
    given = eval(compile(ast.Expression(node.value), "09", "eval"), {"dict": dict})
    assert given == {k: bench.ACCURACY_SWEEP[k] for k in given}
    assert bench._parser().parse_args([]).global_batches is None   # the sweep's own batches


def test_accuracy_text_tells_too_few_steps_from_instability():
    def run(policy, batch, accuracy, losses, steps):
        return {"policy": policy, "global_batch": batch, "nprocs": 1, "grad_accum": batch // 16,
                "steps": steps, "lr": 0.01, "accuracy": accuracy, "losses": losses,
                "status": "ok"}
    runs = [run("rule", 16, 0.96, [1.0, 0.2], 170), run("rule", 64, 0.95, [1.8, 0.5], 44),
            run("rule", 256, 0.10, [2.4, 2.5], 12), run("same lr", 256, 0.57, [2.4, 2.1], 12),
            run("rule, seed 1", 256, 0.58, [2.1, 1.6], 12)]
    text = bench.accuracy_text(runs, predicted={4: True, 16: True})
    assert "small batch" in text and "  170 " in text
    assert "rule at 4x: 1.0 points below the small batch: the rule carries" in text
    assert "rule at 16x: 86.0 points below the small batch, training loss rose: unstable" in text
    assert "rule, seed 1 at 16x" in text and "+1.0 points" in text and "too few steps" in text
    assert "same lr at 16x: 39.0 points below, training loss fell, 12 steps" in text
    assert "the rule carries at 4x: True; you predicted True: right" in text
    assert "the rule carries at 16x: False; you predicted True: not so" in text


def test_the_input_pipeline_helpers_read_a_runs_metrics():
    class Run:
        def __init__(self, events):
            self.events = events

        def events_of(self, kind):
            return self.events

    def steps(epoch, wait):
        return {"name": "steps", "rank": 0, "epoch": epoch, "wait_ms": wait, "compute_ms": 10.0,
                "mean_wait_ms": wait + 1, "mean_compute_ms": 11.0, "first_wait_ms": 50.0,
                "wait_share": 0.25}
    draws = [{"name": "draws", "rank": r, "epoch": e, "workers": [10 + e], "value": [0.5, 0.25]}
             for r in (0, 1) for e in (0, 1)]
    runs = {"a": Run([steps(0, 9.0), steps(1, 4.0), *draws]), "b": Run([steps(0, 2.0)])}
    got = bench.pipeline_steps(runs)
    assert got["a"]["wait_ms"] == 4.0 and got["b"]["wait_ms"] == 2.0        # the last epoch
    supply = bench.supply_ms({"a": ["--decode-ms", 1, "--num-workers", "2"], "b": []}, 32)
    assert supply == {"a": 16.0, "b": 0.0}
    text = bench.pipeline_text(got, supply, wait_only=["b"])
    assert "   16.0    4.0    10.0      16.0   50.0    25%" in text
    assert text.splitlines()[-1].split()[1:5] == ["0.0", "2.0", "-", "-"]
    assert bench.loader_draws(runs["a"])[1, 1]["workers"] == [11]
    assert "rank 1: worker pids epoch 1 [10], epoch 2 [11]; first draws [0.5, 0.25]" in (
        bench.draws_text(runs, ["a"]))


def test_cnn_flops_grow_with_the_square_of_the_width_in_two_convolutions():
    from ddplab.models import SmallCNN

    narrow, wide = (bench.forward_flops(SmallCNN(1, 10, width=w)) for w in (32, 64))
    # multiply-adds: 3 convolutions (8x8, 8x8, then 4x4 after the pool) and the 2x2x64 head
    assert narrow == 2 * (9 * 64 * 32 + 9 * 64 * 32 * 64 + 9 * 16 * 64 * 64 + 4 * 64 * 10)
    assert 3.9 < wide / narrow < 4


def test_source_model_fits_the_single_and_two_gpu_epochs_and_grows_the_all_reduce():
    model = bench.source_model((1, 2, 4, 8))
    single, pair = bench.SOURCE_SECONDS["single"][1], bench.SOURCE_SECONDS["DDP x2"][1]
    assert math.isclose(model[1], single) and math.isclose(model[2], pair)   # the fitted rows
    allreduce = 2 * pair - single                # an epoch's all-reduces, each GPU sending once
    assert math.isclose(model[4], (single + 1.5 * allreduce) / 4)             # 2(n-1)/n at 4
    assert model[8] < model[4] < model[2]                                     # still shrinking
    assert math.isclose(model[8] * 8 - single, 1.75 * allreduce)              # bytes grow only


def test_verdict_can_judge_on_another_span_of_the_runs():
    from ddplab.lab.demos.timing import middle_half

    fast, slow = [10.0, 10.0, 10.0, 10.0, 30.0], [20.0, 20.0, 20.0, 20.0, 20.0]   # an outlier
    assert bench.verdict(slow, fast) == "no clear difference"                   # full ranges meet
    assert bench.verdict(slow, fast, spread=middle_half) == "faster"           # middle halves apart
    assert bench.verdict(fast, slow, spread=middle_half) == "slower"
