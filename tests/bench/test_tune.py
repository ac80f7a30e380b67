"""The microbatch tuner: the memory meter, the search, bad inputs, real CPU probes and the notebook."""
from __future__ import annotations

import math
from pathlib import Path

import nbformat
import pytest
import torch

from cflib.bench.memory import TensorMemory
from cflib.bench.search import GIB, Probe, local_line, search
from cflib.bench.tune import TuneParams, batch_plan, measure_probe, prepare_tuning, probe_shard, train_sft_params
from cflib.train.params import ParamError, load_params_file

ROOT = Path(__file__).resolve().parents[2]
TUNE_NB = ROOT / "notebooks" / "tune_microbatch.ipynb"
SMOKE = load_params_file(ROOT / "params" / "tune_smoke.yaml")


# --- the CPU meter --------------------------------------------------------------------------------
def test_tensor_memory_counts_storages_once_and_frees_them():
    meter = TensorMemory()
    with meter:
        a = torch.zeros(1000)  # 4,000 bytes
        view = a[10:20].view(2, 5)  # same storage: nothing more
        a.add_(1.0)  # in place: nothing more
        b = a * 2  # 4,000 more
        assert meter.live_bytes == 8000
        del a, view, b
    assert meter.live_bytes == 0 and meter.peak_bytes == 8000


def test_tensor_memory_cap_raises_out_of_memory_inside_backward():
    x = torch.randn(128, 128, requires_grad=True)
    meter = TensorMemory()
    with meter:
        loss = (x @ x).relu().sum()
    meter.limit_bytes = meter.live_bytes + 100  # the forward fits, the backward's gradients do not
    with pytest.raises(torch.OutOfMemoryError, match="budget cap"):
        with meter:
            loss.backward()


# --- the search, on memory curves with known answers -----------------------------------------------
def curve(intercept: float, slope: float, cap: float, wobble: float = 0.0, kink_until: int = 0,
          jump: float = 0.0, jump_from: int = 0):
    """A measure(): affine peaks, optional allocator-like wobble, a loss-chunk kink below `kink_until`,
    a step of `jump` bytes from `jump_from` on (a kernel that needs a larger workspace), out of memory past the cap."""
    def measure(micro: int) -> Probe:
        peak = intercept + slope * micro + wobble * math.sin(7.3 * micro)
        if micro < kink_until:  # loss buffers not yet full: less than the line
            peak -= 0.3 * slope * (kink_until - micro) / kink_until
        if jump_from and micro >= jump_from:
            peak += jump
        if peak > cap:
            return Probe(micro, "out_of_memory", None, {"error": "synthetic"})
        return Probe(micro, "fits" if peak <= usable_of(cap) else "over_budget", int(peak))
    return measure


def usable_of(cap: float) -> float:
    return cap * 0.98


def true_largest(measure, max_micro: int = 512) -> int:
    return max(m for m in range(1, max_micro + 1) if measure(m).fits)


@pytest.mark.parametrize("intercept_gib", [2.5, 3.0, 4.5])
@pytest.mark.parametrize("slope_gib", [0.4, 1.0, 2.06, 3.1])
@pytest.mark.parametrize("wobble_gib", [0.0, 0.05])
def test_search_finds_the_largest_fitting_microbatch_of_a_40_gib_budget_in_four_probes(intercept_gib, slope_gib,
                                                                                          wobble_gib):
    cap = 40 * GIB
    measure = curve(intercept_gib * GIB, slope_gib * GIB, cap, wobble_gib * GIB, kink_until=2)
    found = search(measure, int(usable_of(cap)), int(cap), int(2.25 * GIB), 512, 4, progress=lambda _: None)
    best = true_largest(measure)
    assert len(found.probes) <= 4
    assert measure(found.micro).fits  # verified by a real probe, never only predicted
    assert best - 1 <= found.micro <= best


def test_search_recovers_from_out_of_memory_where_memory_jumps_above_the_line():
    # From 30 on a kernel needs 2 GiB more: the line through 1 and 9 sends probe 3 into the cap.
    measure = curve(3 * GIB, 1 * GIB, 40 * GIB, jump=2 * GIB, jump_from=30)
    found = search(measure, int(usable_of(40 * GIB)), 40 * GIB, 0, 512, 4, progress=lambda _: None)
    assert [p.outcome for p in found.probes][2] == "out_of_memory"
    assert found.micro == true_largest(measure) == 34


def test_search_stops_at_max_micro_batch():
    measure = curve(1 * GIB, 0.01 * GIB, 40 * GIB)
    found = search(measure, int(usable_of(40 * GIB)), 40 * GIB, 0, 16, 4, progress=lambda _: None)
    assert found.micro == 16 and "max_micro_batch" in found.stopped_because


@pytest.mark.parametrize("intercept_gib", [38.5, 45.0], ids=["over-usable", "out-of-memory"])
def test_microbatch_one_that_does_not_fit_names_the_budget(intercept_gib):
    measure = curve(intercept_gib * GIB, 1 * GIB, 40 * GIB)
    with pytest.raises(ParamError, match="microbatch 1 does not fit.*budget_gib"):
        search(measure, int(usable_of(40 * GIB)), 40 * GIB, 0, 512, 4, progress=lambda _: None)


def test_line_interpolates_across_the_budget_and_ignores_out_of_memory_probes():
    probes = [Probe(1, "fits", 5), Probe(10, "fits", 50), Probe(12, "over_budget", 60), Probe(20, "out_of_memory", None)]
    line = local_line(probes)
    assert line.through == (10, 12) and line.slope == 5 and line.largest_under(57) == 11


# --- batch arithmetic ----------------------------------------------------------------------------
def test_batch_plan_divides_or_says_so_and_proposes_choices():
    assert batch_plan(64, 16, 1) == {"micro_batch_per_rank": 16, "grad_accum": 4, "global_batch": 64,
                                     "world_size": 1, "note": None}
    plan = batch_plan(64, 17, 1)
    assert plan["micro_batch_per_rank"] == 16 and plan["grad_accum"] == 4
    assert "not a multiple" in plan["note"] and "global_batch 51 or 68" in plan["note"]
    plan = batch_plan(96, 13, 4)  # 96 / 4 ranks = 24 per rank: 12 is the largest divisor under 13
    assert plan["micro_batch_per_rank"] == 12 and plan["grad_accum"] == 2


# --- bad inputs: clear errors naming the parameter, before any probe ----------------------------
@pytest.mark.parametrize("change, culprit", [
    ({"headroom": 1.0}, "headroom"),
    ({"headroom": -0.1}, "headroom"),
    ({"headroom": "nan"}, "headroom"),
    ({"budget_gib": 0}, "budget_gib"),
    ({"budget_gib": 1e30}, "budget_gib must be a positive number of GiB up to 4096"),
    ({"max_micro_batch": 10**9}, "max_micro_batch must be at most 65,536"),
    ({"max_micro_batch": 65_536, "seq_len": 16_384}, "max_micro_batch 65,536 x seq_len 16,384 needs a probe shard"),
    ({"budget_gib": None}, "budget_gib is required on a CPU"),
    ({"model": "tr_hash_200m", "seq_len": 2048, "budget_gib": 3.0}, "budget_gib .* below the fixed memory"),
    ({"seq_len": 4096}, "seq_len 4,096 exceeds the model's max_position_embeddings 256: .* rope_scaling"),
    ({"global_batch": 6, "world_size": 4}, "global_batch 6 is not a multiple of world_size 4"),
    ({"max_probes": 1}, "max_probes"),
    ({"loss_chunk_tokens": 0}, "loss_chunk_tokens"),
    ({"use_custom_kernels": "sometimes"}, "use_custom_kernels"),
    ({"budget": 1.0}, "unknown parameter 'budget'"),
])
def test_bad_tuning_inputs_fail_before_any_probe(change, culprit, tmp_path):
    with pytest.raises(ParamError, match=culprit):
        prepare_tuning(TuneParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "out"), **change}))
    assert not (tmp_path / "out").exists()


def test_a_longer_context_is_tuned_as_the_run_would_train_it(tmp_path):
    """rope_scaling extends the model's positions for the probes, and the params written for train_sft name it."""
    scaling = {"rope_type": "linear", "factor": 2.0}
    tuning = prepare_tuning(TuneParams.from_dict({**SMOKE, "seq_len": 512, "max_micro_batch": 8,
                                                  "rope_scaling": scaling, "out_dir": str(tmp_path / "out")}))
    # the model's: the positions before scaling named (cflib.train.positions); the params written: the run's
    assert (tuning.config.rope_scaling, tuning.config.max_position_embeddings) == (
        {**scaling, "original_max_position_embeddings": 256}, 512)
    assert tuning.params.train_params(2, "embedded").rope_scaling == scaling
    written = train_sft_params(tuning, {"micro_batch_per_rank": 2, "global_batch": 64})
    assert (written["rope_scaling"], written["seq_len"]) == (scaling, 512) and "rope_theta" not in written


def test_an_out_dir_holding_files_is_refused(tmp_path):
    (tmp_path / "record.json").write_text("{}")
    with pytest.raises(ParamError, match="out_dir"):
        prepare_tuning(TuneParams.from_dict({**SMOKE, "out_dir": str(tmp_path)}))


# --- real probes on the CPU ------------------------------------------------------------------------
def test_an_out_of_memory_probe_is_freed_completely(tmp_path):
    tuning = prepare_tuning(TuneParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "out")}))
    with probe_shard(tuning.config, tuning.params.seq_len, 64, seed=0, beside=tmp_path / "probe") as shard:
        assert shard.parent == tmp_path and shard.name.startswith(".probe.staging-")  # beside, never in /tmp
        before = measure_probe(tuning, shard, 4)
        failed = measure_probe(tuning, shard, 64)  # far past the 12 MiB cap
        after = measure_probe(tuning, shard, 4)
    assert not shard.exists()
    assert before.fits and failed.outcome == "out_of_memory" and failed.peak_bytes is None
    assert "budget cap" in failed.detail["error"] and failed.detail["model_freed"]
    assert after.peak_bytes == before.peak_bytes  # nothing of the failed probe is left to count


def test_peak_memory_is_affine_in_the_microbatch_over_whole_loss_chunks(tmp_path):
    tuning = prepare_tuning(TuneParams.from_dict({**SMOKE, "budget_gib": 1.0, "out_dir": str(tmp_path / "o")}))
    with probe_shard(tuning.config, tuning.params.seq_len, 64, seed=0, beside=tmp_path / "probe") as shard:
        peaks = [measure_probe(tuning, shard, m).peak_bytes for m in (8, 12, 16)]
    # 4 rows of 63 supervised tokens (a row's last position has no next token) nearly fill a loss chunk of 256:
    # the growth per 4 rows is the same to within the chunks' unfilled tail.
    growth = (peaks[1] - peaks[0], peaks[2] - peaks[1])
    assert min(growth) > 0 and abs(growth[1] - growth[0]) <= 0.02 * growth[0], growth


# --- the notebook ----------------------------------------------------------------------------------
def parameters_cell(path: Path) -> dict:
    import ast

    cell = next(c for c in nbformat.read(path, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    return {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body if isinstance(n, ast.Assign)}


def test_notebook_parameters_are_the_smoke_profile_over_the_defaults():
    defaults = {name: getattr(TuneParams(), name) for name in TuneParams.names()}
    assert parameters_cell(TUNE_NB) == {**defaults, **SMOKE}
