"""benchmarks/profile_families.py: each kernel of a profile sorted into its family by name (library kernels by
pattern, inductor's fused kernels by the ops they list, GPU annotations left out), and the families of two profiles
side by side with their difference."""
from __future__ import annotations

import json

import pytest
from profile_families import FAMILIES, families, family, table


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_128x192_64x4_1x2_h_bz_coopA_TNT", "GEMMs"),
    ("flash_attn.cute.flash_bwd_sm90.FlashAttentionBackwardSm90_kernel", "attention"),
    ("_add_rms_norm_forward_kernel", "norms"),
    ("_qk_norm_rope_backward_kernel", "RoPE / QK-norm"),
    ("_scaled_swiglu_backward_kernel", "SwiGLU / TR-MoE"),
    ("_fused_linear_cross_entropy_kernel", "loss"),
    ("_adamw_kernel", "optimizer"),
    ("triton_red_fused__log_softmax_nll_loss_3", "loss"),
    ("triton_poi_fused__to_copy_view_12", "copies / casts / fills"),
    ("triton_poi_fused_add_mul_7", "elementwise"),
    ("## Call CompiledFxGraph fbx3kz ##", None),
    ("Optimizer.step#AdamW.step", None),
    ("some_kernel_of_no_known_family", "other"),
])
def test_each_kernel_is_sorted_into_its_family_by_name(name, kind):
    assert family(name) == kind


def test_families_sum_ms_and_launches_and_the_table_shows_the_difference(tmp_path):
    ours = [{"name": "nvjet_a", "ms_per_step": 50.0, "calls_per_step": 100},
            {"name": "nvjet_b", "ms_per_step": 2.5, "calls_per_step": 10},
            {"name": "_adamw_kernel", "ms_per_step": 1.8, "calls_per_step": 3},
            {"name": "## Call CompiledFxGraph x ##", "ms_per_step": 40.0, "calls_per_step": 1}]
    theirs = [{"name": "nvjet_a", "ms_per_step": 60.0, "calls_per_step": 120}]
    assert families(ours)["GEMMs"] == [52.5, 110] and families(ours)["optimizer"] == [1.8, 3]
    assert sum(ms for ms, _ in families(ours).values()) == pytest.approx(54.3)  # the annotation not counted
    assert set(families(ours)) == set(FAMILIES)
    paths = []
    for name, kernels in (("ours", ours), ("theirs", theirs)):
        paths.append(tmp_path / f"{name}-kernels.json")
        paths[-1].write_text(json.dumps(kernels))
    lines = table(paths).splitlines()
    assert lines[0] == "| family | ours ms (launches) | theirs ms (launches) | theirs - ours ms |"
    assert "| GEMMs | 52.5 (110) | 60.0 (120) | +7.5 |" in lines
    assert "| optimizer | 1.8 (3) | 0.0 (0) | -1.8 |" in lines
    assert lines[-1] == "| total | 54.3 (113) | 60.0 (120) | +5.7 |"
    assert not any(line.startswith("| attention |") for line in lines)  # a family neither profile has
