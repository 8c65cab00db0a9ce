"""ddplab.lab.demos.dataparallel: DataParallel by hand and the module. prefix, as lesson 02 claims."""

from __future__ import annotations

import pytest
import torch

from ddplab import checkpoint, models
from ddplab.lab.demos import dataparallel
from ddplab.lab.showcode import source


def _cnn(name: str = "cnn") -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build_model(name, num_classes=10, in_channels=1)


@pytest.mark.parametrize("batch,gpus,sizes", [(32, 4, [8, 8, 8, 8]), (10, 4, [3, 3, 3, 1]),
                                              (6, 4, [2, 2, 2]), (5, 1, [5])])
def test_scatter_sizes_follow_tensor_chunk(batch, gpus, sizes):
    assert dataparallel.scatter_sizes(batch, gpus) == sizes


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_data_parallel_by_hand_equals_the_full_batch_without_batchnorm(devices):
    result = dataparallel.dp_by_hand(_cnn(), "cnn", batch_size=30, devices=devices)
    assert result.equal and result.max_rel_diff < 1e-5
    assert sum(result.chunk_sizes) == 30 and result.model == "cnn"


def test_batchnorm_breaks_the_equality():
    result = dataparallel.dp_by_hand(_cnn("cnn_bn"), devices=2)
    assert not result.equal and result.max_rel_diff > 1e-2
    assert result.model == "SmallCNN"  # named after its class when no name is given


def test_by_hand_matches_a_sum_of_per_chunk_gradients():
    """The reduce step is a sum: each replica's loss share is its chunk's part of the mean."""
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 4)
    x, y = torch.randn(8, 3), torch.randint(0, 4, (8,))
    dp = dataparallel.data_parallel_gradient(model, x, y, 2)
    by_chunk = [dataparallel.full_batch_gradient(model, xc, yc)
                for xc, yc in zip(x.chunk(2), y.chunk(2))]
    for name in dp:
        assert torch.allclose(dp[name], sum(g[name] for g in by_chunk) / 2, atol=1e-6)
    assert model.weight.grad is None        # the caller's model is never touched


@pytest.mark.parametrize("use_data_parallel", [True, False])
def test_module_prefix_error_and_both_fixes(use_data_parallel):
    demo = dataparallel.module_prefix_demo(_cnn, checkpoint.strip_module_prefix,
                                           use_data_parallel=use_data_parallel)
    assert demo.wrapper == ("DataParallel" if use_data_parallel else "Wrapper")
    assert all(k.startswith("module.") for k in demo.wrapped_keys)
    assert not any(k.startswith("module.") for k in demo.plain_keys)
    # the refusal names the wrapped keys it did not expect and the plain keys it missed
    assert demo.wrapped_keys[0] in demo.error and demo.plain_keys[0] in demo.error
    assert list(demo.fixes.values()) == [True, True]


def test_a_repair_that_leaves_the_prefix_is_not_counted_as_a_fix():
    demo = dataparallel.module_prefix_demo(_cnn, lambda state: dict(state),
                                           use_data_parallel=False)
    assert list(demo.fixes.values()) == [True, False]


def test_sections_of_the_by_hand_code_can_be_shown():
    for name in ("scatter", "replicate", "parallel_apply", "gather", "reduce"):
        assert source("ddplab/lab/demos/dataparallel.py", name).strip()


def test_reused_replicas_give_the_same_gradient_and_only_the_copies_asked_for():
    """Lesson 02 times the step without its replicate step: reusing copies computes the same."""
    model = _cnn()
    x, y = torch.randn(10, 1, 8, 8), torch.randint(0, 10, (10,))
    made_once = [_cnn() for _ in range(4)]
    fresh = dataparallel.data_parallel_gradient(model, x, y, 4)
    reused = dataparallel.data_parallel_gradient(model, x, y, 4, made_once)
    assert all(torch.equal(fresh[name], reused[name]) for name in fresh)
    # 6 samples on 4 GPUs make 3 chunks: the fourth copy stays unused, as a GPU would idle
    copies = [_cnn() for _ in range(4)]
    dataparallel.data_parallel_gradient(model, x[:6], y[:6], 4, copies)
    assert [all(p.grad is not None for p in c.parameters()) for c in copies] == [True] * 3 + [
        False]


def test_time_copies_times_one_copy_of_every_model_untouched_on_one_thread():
    small, large = _cnn(), models.build_model("cnn_bn")
    before = [p.detach().clone() for p in small.parameters()]
    threads = torch.get_num_threads()
    timings = dataparallel.time_copies({"cnn": small, "cnn_bn": large}, repeats=3)
    assert [t.model for t in timings] == ["cnn", "cnn_bn"]
    assert all(len(t.times) == 3 and all(s > 0 for s in t.times) for t in timings)  # no warm-up
    assert timings[0].nbytes == sum(p.numel() * 4 for p in small.parameters())   # no buffers
    assert timings[1].nbytes == sum(t.numel() * t.element_size()
                                    for t in [*large.parameters(), *large.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(before, small.parameters()))
    assert torch.get_num_threads() == threads


def test_memory_by_hand_gives_every_gpu_a_gradient_at_the_peak_and_gpu_0_the_sum():
    model = models.build_model("cnn")
    weights = sum(p.numel() * 4 for p in model.parameters())
    rows = dataparallel.memory_by_hand(model, 10, 4, image_shape=(1, 8, 8), num_classes=10)
    assert [r["GPU"] for r in rows] == [0, 1, 2, 3]
    # GPU 0 holds the whole batch (the worker moves it there; its chunk is a view of it)
    assert [r["input"] for r in rows] == [10 * 64 * 4, 3 * 64 * 4, 3 * 64 * 4, 64 * 4]
    assert all(r["replica's gradient"] == weights for r in rows)   # each replica's, on its GPU
    assert rows[0]["summed gradient (.grad)"] == rows[0]["momentum"] == weights
    assert rows[0]["gathered outputs, labels"] == 10 * (10 * 4 + 8)        # logits and int64s
    assert all(r["summed gradient (.grad)"] == r["momentum"] == r["gathered outputs, labels"]
               == r["after backward"] == 0 for r in rows[1:])
    assert rows[0]["after backward"] == 3 * weights       # no buffers: weights, .grad, momentum
    assert all(r["peak"] == sum(v for k, v in r.items() if k not in ("GPU", "peak",
                                                                    "after backward"))
               for r in rows)
    assert len(dataparallel.memory_by_hand(model, 3, 8)) == 3              # idle GPUs: no row


def test_time_steps_times_the_plain_step_then_the_by_hand_step_untouched_on_one_thread():
    model = _cnn()
    before = [p.detach().clone() for p in model.parameters()]
    threads = torch.get_num_threads()
    timings = dataparallel.time_steps(model, batch_size=8, devices=(2, 4), repeats=3)
    assert [t.devices for t in timings] == [1, 2, 4]
    assert all(len(t.times) == 3 and all(s > 0 for s in t.times) for t in timings)  # no warm-up
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.get_num_threads() == threads
    step = dataparallel.StepTiming(2, times=[0.008, 0.002, 0.004, 0.012, 0.006])
    assert step.median == pytest.approx(0.006) and step.spread == pytest.approx((0.004, 0.008))


def test_compare_calls_a_difference_only_on_apart_middle_halves_and_medians_over_10_percent():
    plain = dataparallel.StepTiming(1, times=[1.0, 1.0, 1.0, 1.0, 9.0])      # one outlier
    assert dataparallel.compare(dataparallel.StepTiming(2, [2.0] * 5), plain) == "slower"
    assert dataparallel.compare(dataparallel.StepTiming(2, [0.5] * 5), plain) == "faster"
    near = dataparallel.StepTiming(2, [1.05] * 5)              # apart, but 5% off the median
    assert dataparallel.compare(near, plain) == "no clear difference"
    wide = dataparallel.StepTiming(2, [0.5, 0.9, 2.0, 3.0, 4.0])   # middle halves overlap
    assert dataparallel.compare(wide, plain) == "no clear difference"


def test_copy_timing_reports_the_median_copy_with_its_spread():
    timing = dataparallel.CopyTiming("cnn", 100, times=[0.008, 0.002, 0.004, 0.012, 0.006])
    assert timing.median == pytest.approx(0.006)
    assert timing.spread == pytest.approx((0.004, 0.008))          # the quartiles


def test_module_prefix_demo_lists_missing_and_unexpected_keys():
    demo = dataparallel.module_prefix_demo(lambda: models.build_model("cnn"),
                                           checkpoint.strip_module_prefix)
    plain = list(models.build_model("cnn").state_dict())
    assert demo.missing == plain
    assert demo.unexpected == ["module." + key for key in plain]
