"""cflib.train.sizing: run arithmetic on hand-computed numbers, cluster-layout validation, the CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cflib.train.sizing
from cflib.train.sizing import SizingError, load_cluster_layout, run_arithmetic, validate_cluster_layout
from cflib.train.sizing import main as sizing_main

ROOT = Path(__file__).resolve().parents[2]

# The 200M release recipe on one 8-GPU node, as a layout author would write it. PyYAML
# reads 2.0e9 as a string (YAML 1.1), which the validator must still take as a number.
GOOD_PLAN_YAML = """\
model:
  preset: tr_hash_200m
parallel: {tp: 1, pp: 1, dp: 8, micro_batch_per_rank: 16, global_batch: 128}
run: {seq_len: 2048, target_tokens: 2.0e9, world_size: 8, tokens_per_s_per_gpu: 140000}
"""

# Hand arithmetic for 2e9 tokens at 16 per rank x 8 GPUs x accum 1 x 2,048 tokens:
#   tokens per step 16 * 8 * 2048           = 262,144
#   steps ceil(2e9 / 262,144 = 7,629.39)    = 7,630   (7,629 steps give 1,999,896,576 < 2e9)
#   processed 7,630 * 262,144               = 2,000,158,720
#   overshoot                               = 158,720 tokens
#   wall 2,000,158,720 / (140,000 * 8)      = 1,785.856 s
TOKENS_PER_STEP = 262_144
STEPS = 7_630
PROCESSED = 2_000_158_720
OVERSHOOT = 158_720
WALL_S = 1_785.856


def good_layout() -> dict:
    return {
        "model": {"preset": "tr_hash_200m"},
        "parallel": {"tp": 1, "pp": 1, "dp": 8, "micro_batch_per_rank": 16, "global_batch": 128},
        "run": {"seq_len": 2048, "target_tokens": 2_000_000_000, "world_size": 8, "tokens_per_s_per_gpu": 140_000},
    }


def with_changes(**sections: dict) -> dict:
    layout = good_layout()
    for name, changes in sections.items():
        layout[name].update(changes)
    return layout


def rejected(layout: dict) -> str:
    with pytest.raises(SizingError) as info:
        validate_cluster_layout(layout)
    return str(info.value)


# --- run_arithmetic ---------------------------------------------------------------------------

def test_arithmetic_of_the_200m_node() -> None:
    r = run_arithmetic(2e9, 8, 16, 2048, 140_000)
    assert r["global_batch"] == 128
    assert r["tokens_per_step"] == TOKENS_PER_STEP
    assert r["steps"] == STEPS
    assert r["tokens_processed"] == PROCESSED
    assert r["overshoot_tokens"] == OVERSHOOT
    assert r["overshoot_pct"] == pytest.approx(100 * OVERSHOOT / 2e9)
    assert r["wall_seconds"] == pytest.approx(WALL_S)
    assert r["wall_hours"] == pytest.approx(WALL_S / 3600)
    assert r["checkpoint_every_steps"] is None and r["checkpoints"] is None


def test_arithmetic_with_accumulation_and_checkpoint_count() -> None:
    # 2 per rank x 4 GPUs x accum 4 x 1,024 = 32,768 tokens/step; 1e6 / 32,768 = 30.5 -> 31 steps.
    r = run_arithmetic(1_000_000, 4, 2, 1024, 1000.0, grad_accum=4, checkpoints=4)
    assert r["tokens_per_step"] == 32_768
    assert r["steps"] == 31
    assert r["tokens_processed"] == 1_015_808
    assert r["overshoot_tokens"] == 15_808
    assert r["wall_seconds"] == pytest.approx(1_015_808 / 4000)
    # ceil(31 / 4) = 8: saves at 8, 16, 24 and the end (31), never more than asked for.
    assert r["checkpoint_every_steps"] == 8
    assert r["checkpoints"] == 4


def test_exact_fit_has_no_overshoot() -> None:
    r = run_arithmetic(10 * TOKENS_PER_STEP, 8, 16, 2048, 140_000, checkpoints=10)
    assert (r["steps"], r["overshoot_tokens"], r["checkpoint_every_steps"], r["checkpoints"]) == (10, 0, 1, 10)


def test_checkpoint_cadence_from_minutes() -> None:
    # A step takes 262,144 / 1,120,000 s; 300 s / that = 1,281.7 -> 1,281 steps (never over 5 min).
    r = run_arithmetic(2e9, 8, 16, 2048, 140_000, checkpoint_every_minutes=5)
    assert r["checkpoint_every_steps"] == 1_281
    assert r["checkpoint_interval_minutes"] <= 5
    assert r["checkpoints"] == 6  # ceil(7,630 / 1,281)
    # Minutes shorter than one step still save every step, not every zero steps.
    assert run_arithmetic(2e9, 8, 16, 2048, 1.0, checkpoint_every_minutes=0.5)["checkpoint_every_steps"] == 1


@pytest.mark.parametrize("field", ["target_tokens", "gpus", "micro_batch_per_rank", "seq_len",
                                   "tokens_per_s_per_gpu", "grad_accum", "checkpoints", "checkpoint_every_minutes"])
@pytest.mark.parametrize("bad", [0, -8, True, "eight"])
def test_arithmetic_refuses_bad_inputs_by_name(field: str, bad: object) -> None:
    args = dict(target_tokens=2e9, gpus=8, micro_batch_per_rank=16, seq_len=2048, tokens_per_s_per_gpu=140_000)
    args[field] = bad
    with pytest.raises(SizingError, match=rf"^{field} must be a positive"):
        run_arithmetic(**args)


def test_arithmetic_refuses_fractions_and_double_cadence() -> None:
    with pytest.raises(SizingError, match="gpus must be a positive integer, got 2.5"):
        run_arithmetic(2e9, 2.5, 16, 2048, 140_000)
    with pytest.raises(SizingError, match="checkpoints and checkpoint_every_minutes"):
        run_arithmetic(2e9, 8, 16, 2048, 140_000, checkpoints=10, checkpoint_every_minutes=5)


# --- cluster layouts ---------------------------------------------------------------------------

def test_good_layout_report(tmp_path: Path) -> None:
    path = tmp_path / "layout.yaml"
    path.write_text(GOOD_PLAN_YAML)
    r = load_cluster_layout(path)
    assert r["source"] == str(path)
    assert (r["world_size"], r["grad_accum"], r["tokens_per_step"], r["steps"]) == (8, 1, TOKENS_PER_STEP, STEPS)
    assert (r["tokens_processed"], r["overshoot_tokens"]) == (PROCESSED, OVERSHOOT)
    assert r["target_tokens"] == 2_000_000_000 and isinstance(r["target_tokens"], int)
    assert r["wall_seconds"] == pytest.approx(WALL_S)
    assert r["params"] == r["params_per_shard"] == 201_194_368


def test_docstring_example_layout_validates(tmp_path: Path) -> None:
    doc = cflib.train.sizing.__doc__
    example = doc[doc.index("    model:"):doc.index("\nA bad layout")]
    path = tmp_path / "layout.yaml"
    path.write_text("\n".join(line[4:] for line in example.splitlines()))
    assert load_cluster_layout(path)["steps"] == STEPS


def test_layout_with_tp_pp_and_accumulation() -> None:
    layout = with_changes(parallel={"tp": 2, "pp": 2, "dp": 2})
    del layout["run"]["world_size"]  # optional: tp x pp x dp
    r = validate_cluster_layout(layout)
    assert r["world_size"] == 8
    assert r["grad_accum"] == 4  # 128 / (16 x dp 2)
    assert r["params_per_shard"] == 201_194_368 // 4
    # Same tokens per step and the same 8 GPUs: same steps and wall time as pure DP.
    assert (r["steps"], r["wall_seconds"]) == (STEPS, pytest.approx(WALL_S))


def test_layout_by_parameter_count_without_throughput() -> None:
    layout = good_layout()
    layout["model"] = {"params": 201194368}
    del layout["run"]["tokens_per_s_per_gpu"]
    r = validate_cluster_layout(layout)
    assert r["preset"] is None and r["params"] == 201_194_368
    assert r["steps"] == STEPS and "wall_seconds" not in r
    # Heads are unknown without a preset, so tp is not checked against them.
    assert validate_cluster_layout(with_changes(parallel={"tp": 4, "dp": 2}) | {"model": {"params": 1e6}})["tp"] == 4


def test_world_size_must_equal_tp_pp_dp() -> None:
    message = rejected(with_changes(run={"world_size": 16}))
    assert message == "layout: run.world_size 16 != parallel.tp 1 x pp 1 x dp 8 = 8"


def test_global_batch_must_divide_by_micro_times_dp() -> None:
    message = rejected(with_changes(parallel={"global_batch": 100}))
    assert message == "layout: parallel.global_batch 100 is not divisible by micro_batch_per_rank 16 x dp 8 = 128"


def test_tp_must_divide_heads_and_kv_heads() -> None:
    # 7 divides the 14 query heads but not the 2 kv heads.
    assert "parallel.tp 7 does not divide num_key_value_heads 2" in rejected(
        with_changes(parallel={"tp": 7}, run={"world_size": 56}))
    assert "parallel.tp 4 does not divide num_attention_heads 14" in rejected(
        with_changes(parallel={"tp": 4, "dp": 2}))


def test_pp_and_seq_len_bounded_by_the_preset() -> None:
    assert "parallel.pp 32 exceeds num_hidden_layers 16" in rejected(
        with_changes(parallel={"pp": 32, "dp": 1, "micro_batch_per_rank": 16}, run={"world_size": 32}))
    assert "run.seq_len 4096 exceeds max_position_embeddings 2048" in rejected(with_changes(run={"seq_len": 4096}))


@pytest.mark.parametrize("section, key, suggestion", [
    ("parallel", "global_bach", "global_batch"),
    ("run", "target_token", "target_tokens"),
    ("model", "preset_name", "preset"),
])
def test_unknown_key_suggests_the_known_one(section: str, key: str, suggestion: str) -> None:
    layout = good_layout()
    layout[section][key] = 1
    assert f"unknown key {section}.{key} (did you mean '{suggestion}'?)" in rejected(layout)


def test_unknown_section_and_preset_suggest() -> None:
    layout = good_layout()
    layout["paralel"] = layout.pop("parallel")
    assert "unknown section 'paralel' (did you mean 'parallel'?)" in rejected(layout)
    assert "model.preset 'tr_hash_200' is not a preset (did you mean 'tr_hash_200m'?)" in rejected(
        with_changes(model={"preset": "tr_hash_200"}))


@pytest.mark.parametrize("section", ["model", "parallel", "run"])
def test_missing_section(section: str) -> None:
    layout = good_layout()
    del layout[section]
    assert f"missing section '{section}'" in rejected(layout)


def test_missing_key_and_model_choice() -> None:
    layout = good_layout()
    del layout["parallel"]["dp"]
    assert rejected(layout) == "layout: missing key parallel.dp"
    assert "exactly one of model.preset or model.params" in rejected(with_changes(model={"params": 1000}))
    assert "exactly one of model.preset or model.params" in rejected(good_layout() | {"model": {}})
    assert "a layout is a mapping" in rejected([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("section, key, value", [
    ("parallel", "dp", -8), ("parallel", "tp", 0), ("parallel", "micro_batch_per_rank", -16),
    ("run", "target_tokens", -2e9), ("run", "seq_len", 2048.5), ("run", "tokens_per_s_per_gpu", -1),
    ("model", "preset", None),
])
def test_bad_numbers_name_the_field(section: str, key: str, value: object) -> None:
    layout = with_changes(**{section: {key: value}})
    assert f"{section}.{key}" in rejected(layout)


def test_load_reports_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(SizingError, match="no such layout file"):
        load_cluster_layout(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(SizingError, match="not valid YAML"):
        load_cluster_layout(bad)


# --- CLI -------------------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cflib.train.sizing", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
def run_cli(capsys):
    """`python -m cflib.train.sizing` in this process (a subprocess would spend seconds importing torch)."""
    def run(*args: str) -> subprocess.CompletedProcess:
        returncode = sizing_main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, returncode, out, err)
    return run


@pytest.mark.slow
def test_cli_check_good_layout(tmp_path: Path) -> None:
    path = tmp_path / "layout.yaml"
    path.write_text(GOOD_PLAN_YAML)
    done = cli("check", str(path))
    assert done.returncode == 0, done.stderr
    assert "optimizer steps" in done.stdout and "7,630" in done.stdout
    assert "158,720" in done.stdout


def test_cli_check_bad_layout(tmp_path: Path, run_cli) -> None:
    path = tmp_path / "layout.yaml"
    path.write_text(GOOD_PLAN_YAML.replace("global_batch: 128", "global_batch: 100"))
    done = run_cli("check", str(path))
    assert done.returncode == 2
    assert "parallel.global_batch 100 is not divisible" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stdout == ""


def test_cli_arithmetic(run_cli) -> None:
    done = run_cli("arithmetic", "--target-tokens", "2e9", "--gpus", "8", "--micro-batch-per-rank", "16",
               "--seq-len", "2048", "--tokens-per-s-per-gpu", "140000", "--checkpoints", "10")
    assert done.returncode == 0, done.stderr
    assert "262,144" in done.stdout and "7,630" in done.stdout and "763 steps" in done.stdout
    bad = run_cli("arithmetic", "--target-tokens", "2e9", "--gpus", "0", "--micro-batch-per-rank", "16",
              "--seq-len", "2048", "--tokens-per-s-per-gpu", "140000")
    assert bad.returncode == 2 and "gpus must be a positive integer" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_rope_scaling_extends_the_preset_s_positions_as_a_run_s_does() -> None:
    extended = with_changes(model={"preset": "tr_hash_200m", "rope_scaling": {"rope_type": "linear", "factor": 4}},
                            run={"seq_len": 8192})
    assert validate_cluster_layout(extended)["seq_len"] == 8192
    assert "run.seq_len 16384 exceeds max_position_embeddings 8192" in rejected(
        {**extended, "run": {**extended["run"], "seq_len": 16384}})
    assert "model.rope_scaling extends it" in rejected(with_changes(run={"seq_len": 4096}))
    assert "model.rope_scaling.rope_type must be one of linear, yarn, llama3" in rejected(
        with_changes(model={"preset": "tr_hash_200m", "rope_scaling": {"rope_type": "dynamic2", "factor": 2}}))
    yarn = {"rope_type": "yarn", "factor": 4}  # on the preset's 2,048 positions, as a run fills them in
    assert validate_cluster_layout(with_changes(model={"preset": "tr_hash_200m", "rope_scaling": yarn},
                                                run={"seq_len": 8192}))["seq_len"] == 8192
    assert "model.rope_scaling.original_max_position_embeddings 8,192 is not the 2,048 positions" in rejected(
        with_changes(model={"preset": "tr_hash_200m", "rope_scaling": {**yarn, "original_max_position_embeddings":
                                                                         8192}}, run={"seq_len": 8192}))
