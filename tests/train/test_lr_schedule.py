"""Learning-rate schedules: each one's factor at its key steps against a plain-Python reference, the released cosine
bit for bit, their settings checked before step 1 (a wsd decay that never falls refused, warmup_steps winning over
warmup_ratio, a one-step run the same under every schedule), and a real run recording the schedule it trained
with."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from sft_shard_helpers import write_shard

from cflib.data.tasks import generate
from cflib.train import train
from cflib.train.optim import SCHEDULES, LrSchedule
from cflib.train.params import ParamError, TrainParams, load_params_file
from cflib.train.records import read_metrics
from cflib.train.run import batch_arithmetic, describe_arithmetic, resolve_schedule

ROOT = Path(__file__).resolve().parents[2]


def released_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """The schedule's factor as released (cflib.train.optim.lr_factor), before schedules could be chosen: the
    default must stay it bit for bit."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, decay_steps) / decay_steps))


def reference(name: str, step: int, warmup: int, total: int, floor: float = 0.0, decay: int = 0) -> float:
    """Each schedule as its definition reads (transformers' conventions: the fall reaches the floor at step
    `total`, one past the last step taken); wsd falls linearly over its last `decay` steps."""
    if step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    start = total - decay if name == "wsd" else warmup
    if step < start:
        return 1.0
    progress = (step - start) / (total - start)
    falling = (1 + math.cos(math.pi * progress)) / 2 if name == "cosine" else 1 - progress
    return floor + (1 - floor) * falling


def schedule(total: int = 20, **params) -> LrSchedule:
    return resolve_schedule(TrainParams.from_dict(params), total)


@pytest.mark.parametrize("name, floor", [("cosine", 0.0), ("cosine", 0.1), ("linear", 0.0), ("linear", 0.25),
                                         ("constant", 0.0), ("wsd", 0.0), ("wsd", 0.1)])
def test_each_schedule_s_factor_at_its_key_steps_matches_the_reference(name, floor):
    # 20 steps, 4 of warm-up; wsd decays over the last 5 (lr_decay_ratio 0.25)
    resolved = schedule(lr_schedule=name, warmup_steps=4, min_lr_ratio=floor,
                        **({"lr_decay_ratio": 0.25} if name == "wsd" else {}))
    decay = 5 if name == "wsd" else 0
    for step in range(20):
        assert resolved.factor(step) == pytest.approx(reference(name, step, 4, 20, floor, decay), abs=1e-15), step
    start, end_of_warmup, middle, last = (resolved.factor(step) for step in (0, 3, 12, 19))
    assert (start, end_of_warmup) == (0.25, 1.0)
    assert middle == pytest.approx({"cosine": floor + (1 - floor) * 0.5, "linear": floor + (1 - floor) * 0.5,
                                    "constant": 1.0, "wsd": 1.0}[name])  # step 12 is half-way through the fall
    assert last == pytest.approx({"cosine": floor + (1 - floor) * (1 + math.cos(math.pi * 15 / 16)) / 2,
                                  "linear": floor + (1 - floor) / 16, "constant": 1.0,
                                  "wsd": floor + (1 - floor) / 5}[name])
    assert all(floor <= resolved.factor(step) <= 1.0 for step in range(20))


def test_wsd_holds_the_peak_until_its_decay_then_falls_linearly():
    resolved = schedule(lr_schedule="wsd", warmup_steps=4, lr_decay_ratio=0.25)
    assert (resolved.warmup_steps, resolved.decay_steps) == (4, 5)
    assert [resolved.factor(step) for step in range(4, 16)] == [1.0] * 12
    assert [resolved.factor(step) for step in range(15, 20)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    # lr_decay_ratio left at None is 0.1, rounded up to whole steps as warmup_ratio is
    default = schedule(total=25, lr_schedule="wsd")
    assert (default.decay_steps, default.lr_decay_ratio) == (3, 0.1)


@pytest.mark.parametrize("warmup, total", [(0, 1), (1, 1), (0, 7), (1, 30), (3, 100), (30, 1000), (99, 100)])
def test_the_default_schedule_is_the_released_cosine_bit_for_bit(warmup, total):
    released = [released_cosine(step, warmup, total) for step in range(total)]
    by_steps = resolve_schedule(TrainParams(warmup_steps=warmup), total)
    assert [by_steps.factor(step) for step in range(total)] == released
    by_ratio = resolve_schedule(TrainParams(), total)  # warmup_ratio 0.03, lr_schedule cosine, min_lr_ratio 0
    assert by_ratio.name == "cosine" and by_ratio.warmup_steps == math.ceil(0.03 * total)
    assert [by_ratio.factor(step) for step in range(total)] == [
        released_cosine(step, math.ceil(0.03 * total), total) for step in range(total)]


def test_the_default_schedule_warms_up_then_follows_one_cosine():
    factors = [schedule(warmup_steps=4).factor(step) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 15 / 16)))


def test_warmup_steps_replaces_warmup_ratio():
    assert schedule(total=100, warmup_steps=7).warmup_steps == 7
    assert schedule(total=100).warmup_steps == 3
    assert schedule(total=100, warmup_steps=0).factor(0) == 1.0


@pytest.mark.parametrize("ratio", [0.03, 0.05, 0.5])
def test_warmup_steps_set_wins_over_any_warmup_ratio_and_says_the_ratio_is_unused(ratio):
    # A ratio at its default or not, from a params file or beside it: warmup_steps decides, no error.
    resolved = schedule(total=100, warmup_steps=7, warmup_ratio=ratio)
    assert resolved.warmup_steps == 7 and resolved.factor(6) == 1.0
    assert {key: resolved.record()[key] for key in ("warmup_steps", "warmup_from", "warmup_ratio")} == {
        "warmup_steps": 7, "warmup_from": "warmup_steps", "warmup_ratio": None}
    assert resolved.describe_warmup() == "7 warm-up (warmup_steps; warmup_ratio unused)"
    by_ratio = schedule(total=100, warmup_ratio=ratio)
    assert {key: by_ratio.record()[key] for key in ("warmup_from", "warmup_ratio")} == {
        "warmup_from": "warmup_ratio", "warmup_ratio": ratio}
    assert by_ratio.describe_warmup() == f"{math.ceil(ratio * 100)} warm-up"


def test_warmup_steps_over_a_params_file_s_warmup_ratio_is_taken():
    # `-f params/quickstart.yaml -p warmup_steps 5`: the file sets warmup_ratio 0.05
    raw = load_params_file(ROOT / "params" / "quickstart.yaml")
    assert raw["warmup_ratio"] == 0.05
    params = TrainParams.from_dict({**raw, "warmup_steps": 5})
    figures = batch_arithmetic(params)
    assert figures["warmup_steps"] == 5 and figures["warmup_from"] == "warmup_steps"
    assert "5 of warm-up (warmup_steps; warmup_ratio unused), then" in describe_arithmetic(figures, params)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("warmup", [{}, {"warmup_steps": 0}, {"warmup_steps": 1}, {"warmup_ratio": 0.5}])
def test_a_one_step_run_takes_its_step_at_the_peak_under_every_schedule(name, warmup):
    resolved = schedule(total=1, lr_schedule=name, **warmup)
    cosine = schedule(total=1, **warmup)
    assert resolved.factor(0) == cosine.factor(0) == 1.0
    assert (resolved.warmup_steps, resolved.decay_steps) == (
        cosine.warmup_steps, 0 if name == "constant" else cosine.decay_steps)
    if name == "wsd":
        assert resolved.describe() == "wsd: its one step at the peak"


@pytest.mark.parametrize("total, raw, words", [
    (10, {}, ["lr_decay_ratio 0.1 gives 1 decay step of the run's 10", "never fall", "at least 0.1001"]),
    (2, {"warmup_steps": 0}, ["lr_decay_ratio 0.1 gives 1 decay step of the run's 2", "at least 0.5001"]),
    (30, {"lr_decay_ratio": 0.03}, ["lr_decay_ratio 0.03 gives 1 decay step of the run's 30", "at least 0.0334"]),
    (1000, {"lr_decay_ratio": 0.001}, ["lr_decay_ratio 0.001 gives 1 decay step of the run's 1000",
                                       "at least 0.00101"]),
])
def test_a_wsd_decay_of_one_step_is_refused_naming_the_smallest_ratio_that_decays(total, raw, words):
    # The first decay step runs at the peak: one decay step would leave the whole run at the peak.
    with pytest.raises(ParamError) as caught:
        schedule(total=total, lr_schedule="wsd", **raw)
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    smallest = float(str(caught.value).split("at least ")[1].split()[0])
    fixed = schedule(total=total, lr_schedule="wsd", **{**raw, "lr_decay_ratio": smallest})
    assert fixed.decay_steps == 2 and fixed.factor(total - 1) < 1.0
    assert fixed.describe() == "wsd: constant, then linear to 0 x lr over the last 2 steps"


@pytest.mark.parametrize("raw, words", [
    ({"lr_schedule": "cosine_with_restarts"}, ["lr_schedule must be one of cosine, linear, constant, wsd",
                                               "'cosine_with_restarts'"]),
    ({"warmup_steps": -1}, ["warmup_steps must be None or >= 0"]),
    ({"min_lr_ratio": 1.0}, ["min_lr_ratio must be in [0, 1)"]),
    ({"min_lr_ratio": -0.1}, ["min_lr_ratio must be in [0, 1)"]),
    ({"min_lr_ratio": "nan"}, ["min_lr_ratio must be a finite number"]),
    ({"min_lr_ratio": 0.1, "lr_schedule": "constant"}, ["min_lr_ratio 0.1", "constant never decays"]),
    ({"lr_decay_ratio": 0.2}, ["lr_decay_ratio 0.2", "only lr_schedule wsd reads it"]),
    ({"lr_decay_ratio": 0.0, "lr_schedule": "wsd"}, ["lr_decay_ratio must be in (0, 1]"]),
    ({"lr_decay_ratio": 1.5, "lr_schedule": "wsd"}, ["lr_decay_ratio must be in (0, 1]"]),
])
def test_schedule_settings_are_refused_by_name(raw, words):
    with pytest.raises(ParamError) as caught:
        TrainParams.from_dict(raw)
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"


@pytest.mark.parametrize("raw, total, words", [
    ({"warmup_steps": 6}, 6, ["warmup_steps 6 would warm up through the whole run of 6 steps", "at most 5"]),
    ({"warmup_steps": 2}, 1, ["warmup_steps 2", "run of 1 step: with 1 step it must be at most 1"]),
    ({"lr_schedule": "wsd", "warmup_steps": 4, "lr_decay_ratio": 0.5}, 6,
     ["lr_schedule wsd: 4 warm-up steps (warmup_steps 4) and 3 decay steps (lr_decay_ratio 0.5)", "run's 6"]),
    ({"lr_schedule": "wsd", "warmup_ratio": 0.5, "lr_decay_ratio": 0.6}, 10, ["(warmup_ratio 0.5)"]),
])
def test_a_schedule_that_does_not_fit_the_run_s_steps_is_refused(raw, total, words):
    with pytest.raises(ParamError) as caught:
        schedule(total=total, **raw)
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"


def test_the_unknown_key_hint_knows_every_schedule_setting():
    with pytest.raises(ParamError, match=r"did you mean 'warmup_steps'"):
        TrainParams.from_dict({"warmup_step": 10})
    assert set(SCHEDULES) == {"cosine", "linear", "constant", "wsd"}


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    train_examples, eval_examples = generate(seed=1)
    return write_shard(tmp_path_factory.mktemp("shard"), train_examples[:32], eval_examples[:4], max_seq_len=64)


def test_a_constant_run_trains_at_its_peak_after_the_warm_up_and_records_its_schedule(tmp_path, shard):
    record = train({"model": "smoke", "data": str(shard), "out_dir": str(tmp_path / "run"), "seq_len": 64,
                    "micro_batch_per_rank": 8, "global_batch": 8, "max_steps": 5, "lr": 2e-3, "device": "cpu",
                    "exact_match_limit": 0, "eval_at_start": False, "lr_schedule": "constant", "warmup_steps": 2},
                   progress=False)
    assert record["params"]["lr_schedule"] == "constant"
    assert {key: record["schedule"][key] for key in ("lr_schedule", "total_steps", "warmup_steps", "decay_steps",
                                                     "min_lr_ratio", "lr_decay_ratio")} == {
        "lr_schedule": "constant", "total_steps": 5, "warmup_steps": 2, "decay_steps": 0, "min_lr_ratio": 0.0,
        "lr_decay_ratio": None}
    assert (record["schedule"]["warmup_from"], record["schedule"]["warmup_ratio"]) == ("warmup_steps", None)
    rates = [row["lr"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if row["event"] == "train"]
    assert rates == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 2e-3], rel=1e-12)
