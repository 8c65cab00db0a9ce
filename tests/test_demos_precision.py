"""ddplab.lab.demos.precision: what lesson 06 shows about float16, bfloat16 and the GradScaler."""

from __future__ import annotations

import inspect

import pytest
import torch

from ddplab.lab.demos import precision


def test_autocast_on_cpu_computes_in_bf16_and_keeps_fp32_weights():
    facts = precision.autocast_facts("cpu")
    assert facts["default"] == torch.bfloat16
    assert facts["matmul"] == facts["linear_output"] == torch.bfloat16
    assert facts["weight"] == facts["grad"] == facts["outside"] == torch.float32
    assert facts["layer_norm"] == torch.bfloat16  # a 16-bit input keeps its dtype on the CPU
    assert facts["loss"] == torch.float32
    assert facts["prod"] == torch.float32  # on the CPU's float32 list
    assert facts["sum"] == facts["softmax"] == torch.bfloat16  # CUDA's list only
    assert facts["exp"] == facts["norm"] == torch.bfloat16  # CUDA's list only


def test_saved_bytes_halves_activations_and_adds_16_bit_weight_copies():
    small = {d: precision.saved_bytes(d, 64) for d in (None, torch.bfloat16)}
    large = {d: precision.saved_bytes(d, 1024) for d in (None, torch.bfloat16)}
    for saved in (small, large):
        fp32, bf16 = saved[None], saved[torch.bfloat16]
        assert fp32["weight_copies"] == 0 and bf16["parameters"] == 0
        assert 0.5 < bf16["activations"] / fp32["activations"] < 0.55  # the loss stays float32
        assert 2 * bf16["weight_copies"] == fp32["parameters"] > 0      # half of what it copies
        assert fp32["parameters"] == 4 * (256 * 256 + 256 * 10)        # not the first layer's
    new = {n: {d: s["activations"] + s["weight_copies"] for d, s in saved.items()}
           for n, saved in (("small", small), ("large", large))}
    assert new["small"][torch.bfloat16] > new["small"][None]   # the copies outweigh the savings
    assert new["large"][torch.bfloat16] < new["large"][None]


def test_number_formats():
    rows = {r["dtype"]: r for r in precision.number_formats()}
    assert rows["float16"]["1e-8"] == 0.0 and rows["float16"]["70000"] == float("inf")
    assert rows["bfloat16"]["1e-8"] > 0 and rows["bfloat16"]["max"] > 1e38


def test_fp16_gradients_underflow_without_a_scaler_and_bf16_ones_do_not():
    assert precision.tiny_gradient(torch.float16, use_scaler=False) == 0.0
    scaled = precision.tiny_gradient(torch.float16, use_scaler=True)
    bf16 = precision.tiny_gradient(torch.bfloat16, use_scaler=False)
    assert scaled == pytest.approx(3e-8, rel=0.01) and bf16 == pytest.approx(3e-8, rel=0.01)


def test_scaler_skips_an_overflowing_step_and_halves_the_scale():
    facts = precision.scaler_overflow_step()
    assert facts["scale_after"] == facts["scale_before"] / 2
    assert not facts["weights_changed"] and facts["then_changed"]


def test_old_amp_names_warn():
    messages = precision.deprecated_amp_names()
    assert any(m.startswith("FutureWarning") for m in messages), messages


def test_matmul_speed_reports_both_precisions_and_restores_threads():
    threads = torch.get_num_threads()
    rows = precision.matmul_speed((16, 32), repeats=2, inner=1)
    assert [r["size"] for r in rows] == [16, 32]
    for r in rows:   # the fastest run is the measurement, the second fastest its check
        for name in ("fp32", "bf16"):
            assert 0 < r[f"{name}_ms"] <= r[f"{name}_second_ms"] <= r[f"{name}_max_ms"]
        assert r["speedup"] == pytest.approx(r["fp32_ms"] / r["bf16_ms"])
        assert r["fp32_gflops"] == pytest.approx(2 * r["size"] ** 3 / r["fp32_ms"] / 1e6)
    assert torch.get_num_threads() == threads



def test_matmul_speed_alternates_fp32_and_bf16_batches():
    seen = []
    real = torch.autocast

    def recording(*args, **kwargs):
        seen.append(kwargs["enabled"])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(precision, "BATCH_MS", 0.0)  # no time target: batches of ``inner``
        patch.setattr(torch, "autocast", recording)
        rows = precision.matmul_speed((8,), repeats=4, inner=3)
    # two warm-up batches, then each repeat times one batch of each, either going first
    assert seen == [False, True, False, True, True, False, False, True, True, False]
    assert rows[0]["fp32_ms"] <= rows[0]["fp32_max_ms"]


def test_native_bf16_reads_the_cpus_flags(monkeypatch):
    from ddplab import env

    monkeypatch.setattr(env, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert precision.native_bf16() == {"avx512_bf16": True, "amx": False}
    monkeypatch.setattr(env, "cpu_flags", lambda: {"amx_tile", "amx_bf16"})
    assert precision.native_bf16() == {"avx512_bf16": False, "amx": True}
    monkeypatch.setattr(env, "cpu_flags", lambda: None)
    assert precision.native_bf16() is None


def _row(size, fp32_ms, bf16_ms, second=1.0):
    return {"size": size, "fp32_ms": fp32_ms, "bf16_ms": bf16_ms, "speedup": fp32_ms / bf16_ms,
            "fp32_second_ms": fp32_ms * second, "bf16_second_ms": bf16_ms * second,
            "fp32_gflops": 2 * size ** 3 / fp32_ms / 1e6}


def test_readings_flag_busy_and_impossible_timings():
    avx512 = {"avx512_bf16": True, "amx": False}
    # a loaded machine's pattern: fp32 at 72, 35, 24 GFLOP/s, bf16 7.28x at 256
    loaded = [_row(64, 0.00728, 0.0080), _row(128, 0.1198, 0.080), _row(256, 1.385, 0.190)]
    assert [round(r["fp32_gflops"]) for r in loaded] == [72, 35, 24]
    assert precision.readings(loaded, avx512) == [
        "steady", "suspect: fp32 slows with size", "suspect: above this CPU's bf16 bound"]
    assert precision.readings(loaded, {"avx512_bf16": True, "amx": True})[2] == \
        "suspect: fp32 slows with size"                   # AMX: no bound on the speed-up
    assert precision.readings(loaded[2:], None) == ["steady"]   # unknown units, nothing smaller
    quiet = [_row(64, 0.010, 0.012), _row(256, 0.50, 0.27), _row(512, 4.0, 2.1, second=1.3)]
    assert precision.readings(quiet, avx512) == ["steady", "steady", "busy: not counted"]


def test_the_bf16_verdict_names_this_cpus_case():
    steady = [{"size": 256, "speedup": 0.8}, {"size": 1024, "speedup": 1.6}]
    native = precision.bf16_verdict(steady, 1.5, "faster", native={"avx512_bf16": True,
                                                                    "amx": False})
    assert "units: AVX-512 BF16" in native and "natively" in native
    assert "bf16 products were faster at size 1024, not at 256." in native   # what was printed
    none = precision.bf16_verdict(steady, 1.5, "faster", native={"avx512_bf16": False,
                                                                  "amx": False})
    assert "units: none" in none and "did not come from them" in none
    assert "nothing to gain (slower)" in precision.bf16_verdict(
        steady, 0.7, "slower", native={"avx512_bf16": False, "amx": False})
    assert "Training gained too." in native                 # 1.5x: less than the 1.6x products
    more = precision.bf16_verdict(steady, 2.2, "faster", native={"avx512_bf16": True,
                                                                  "amx": False})
    assert "more than the products above: probably noise" in more   # no cause named
    busy_launches = precision.bf16_verdict(steady, 2.07, "machine busy: re-run",
                                           native={"avx512_bf16": True, "amx": False})
    assert "spread over 2x" in busy_launches and "2.07x" not in busy_launches   # ratio not read
    unknown = precision.bf16_verdict([], 1.0, "no clear difference")
    assert "unknown" in unknown and "none (busy or suspect at every size)" in unknown
    busy = precision.bf16_verdict([], 2.2, "faster", native={"avx512_bf16": True, "amx": False})
    assert busy.splitlines()[-1] == "Verdict: no steady measurement; re-run the cell above."
    assert "ran on GPUs" in precision.bf16_verdict(steady, 1.2, "faster", gpus=2)
    one = precision.bf16_verdict([{"size": 64, "speedup": 0.09}], 2.0, "faster",
                                 native={"avx512_bf16": True, "amx": False})
    assert "only size 64 was steady, a thin reading" in one and "at none" not in one
    assert "were not faster there" in one           # said of size 64 alone, not of every size


def test_matmul_speed_times_sizes_up_to_512_by_default():
    assert inspect.signature(precision.matmul_speed).parameters["sizes"].default == (
        64, 128, 256, 512)


def test_the_speed_verdict_calls_a_busy_machine_before_any_difference():
    busy_fp32, busy_bf16 = [927, 1100, 1388], [1587, 2900, 6640]    # a 4x spread, median 2.6x
    assert precision.speed_verdict(busy_fp32, busy_bf16) == "machine busy: re-run"
    assert precision.speed_verdict(busy_bf16, busy_fp32) == "machine busy: re-run"
    assert precision.speed_verdict([1000, 1050, 1100], [1150, 1200, 1250]) == "faster"
    assert precision.speed_verdict([1000, 1050, 1100], [800, 850, 900]) == "slower"
    assert precision.speed_verdict([1000, 1050, 1100], [1080, 1200, 1250]) == \
        "no clear difference"                                     # the spreads overlap
    assert precision.speed_verdict([1000, 1050, 1100], [1110, 1120, 1130], noise=0.10) == \
        "no clear difference"                                     # apart, but within 10%
