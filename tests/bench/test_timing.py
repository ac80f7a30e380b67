"""The kernel timeline a profile reports: busy time as the union of kernel intervals, and the gaps between."""
import pytest

from cflib.bench.timing import kernel_timeline, kernel_totals


def test_timeline_unions_overlaps_and_splits_gaps_by_length():
    # microseconds: two overlapping kernels, a 5 us gap, a nested kernel, a 100 us gap, a last kernel
    spans = [(0.0, 100.0, "a"), (50.0, 150.0, "b"), (155.0, 255.0, "c"), (160.0, 200.0, "d"), (355.0, 455.0, "e")]
    found = kernel_timeline(spans, steps=1, wall_ms=0.5)
    assert found["gpu_busy_ms_per_step"] == pytest.approx(0.35)  # 150 + 100 + 100 us
    assert found["gpu_idle_ms_per_step"] == pytest.approx(0.15)
    assert found["kernels_per_step"] == 5
    assert found["long_gaps_per_step"] == 1 and found["long_gap_ms_per_step"] == pytest.approx(0.1)
    assert found["largest_gaps"] == [{"us": 100.0, "after": "c", "before": "e"}]
    assert found["short_gap_ms_per_step"] == pytest.approx(0.005)


def test_timeline_divides_by_steps_and_takes_a_threshold():
    spans = [(0.0, 10.0, "a"), (40.0, 50.0, "b"), (60.0, 70.0, "c")]  # gaps of 30 and 10 us
    found = kernel_timeline(spans, steps=2, wall_ms=0.1, gap_us=5.0)
    assert found["long_gaps_per_step"] == 1 and found["long_gap_ms_per_step"] == pytest.approx(0.02)
    assert found["short_gap_ms_per_step"] == 0 and found["gpu_busy_ms_per_step"] == pytest.approx(0.015)
    assert kernel_timeline([], steps=1, wall_ms=1.0)["gpu_idle_ms_per_step"] == 1.0


def test_kernel_totals_sum_each_name_per_step_largest_first():
    spans = [(0.0, 100.0, "gemm"), (100.0, 130.0, "triton_poi_fused_add_0"), (200.0, 300.0, "gemm"),
             (300.0, 310.0, "Memcpy DtoD (Device -> Device)")]
    assert kernel_totals(spans, steps=2) == [
        {"name": "gemm", "ms_per_step": 0.1, "calls_per_step": 1.0},
        {"name": "triton_poi_fused_add_0", "ms_per_step": 0.015, "calls_per_step": 0.5},
        {"name": "Memcpy DtoD (Device -> Device)", "ms_per_step": 0.005, "calls_per_step": 0.5}]
