"""validate_kernels' plumbing (cflib.bench.validate, cflib.bench.components): every component compared as the
notebook compares it, a broken kernel caught, the tolerances of docs/formats.md#numerical-tolerances.

Each op's own test beside its reference is in tests/ops/. Without a GPU the Triton kernels run in
Triton's interpreter (tests/conftest.py).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import TOLERANCES as OP_TEST_TOLERANCES

from cflib.bench.components import COMPONENTS, TOLERANCES, Shape, shapes_for
from cflib.bench.validate import check, compare, validate
from cflib.model.config import ModelConfig

CPU = torch.device("cpu")
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else CPU
TINY = shapes_for(CPU)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("component", COMPONENTS, ids=lambda c: c.name)
def test_fast_path_matches_reference_forward_and_backward(component, dtype):
    rows, skipped = validate(DEVICE, dtypes=(dtype,), shapes=[TINY], components=[component])
    if skipped:
        pytest.skip(skipped[0]["reason"])
    check(rows)  # raises, naming every broken tolerance
    assert {r["tensor"] for r in rows} >= {"out"} and len(rows) >= 2  # the output and at least one gradient
    assert all(r["backend"] == component.backend for r in rows)


def test_a_broken_kernel_is_caught(monkeypatch):
    """The comparison can fail: a fast path off by 1% breaks the fp32 tolerance."""
    trmoe = next(c for c in COMPONENTS if c.name == "trmoe")
    broken = type(trmoe)(**{**trmoe.__dict__, "fast": lambda inputs: (lambda out, b: (out * 1.01, b))(
        *trmoe.fast(inputs))})
    rows = compare(broken, TINY, "float32", DEVICE)
    assert not any(r["passed"] for r in rows if r["tensor"] == "out")
    with pytest.raises(AssertionError, match="trmoe out"):
        check(rows)


def test_trmoe_kernel_takes_unequal_route_weights_and_repeated_routes():
    """Primary and other route weights differ, and a token routed twice to one expert gets both weights."""
    config = ModelConfig(**{**TINY.config.to_dict(), "num_experts_per_tok": 3, "top_k_primary_weight": 0.6})
    trmoe = next(c for c in COMPONENTS if c.name == "trmoe")

    def inputs(shape, gen, device):
        found = trmoe.inputs(shape, gen, device)
        found["route_table"] = found["route_table"].clone()
        found["route_table"][2, ::2] = found["route_table"][0, ::2]  # every other token: its primary expert twice
        return found

    rows = compare(dataclasses.replace(trmoe, inputs=inputs), Shape("routes", config, 2, 12), "float32", DEVICE)
    check(rows)


def test_tolerances_are_stated_per_dtype():
    assert TOLERANCES["float32"] < TOLERANCES["bfloat16"] <= 2e-2


def test_the_op_tests_hold_kernels_to_the_notebooks_tolerances():
    assert {str(dtype).removeprefix("torch."): value for dtype, value in OP_TEST_TOLERANCES.items()} == TOLERANCES
