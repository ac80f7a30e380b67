"""cflib.train.params: every parameter is checked before anything runs, and errors name it."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from cflib.bench.throughput import ThroughputParams
from cflib.train.params import ParamError, TrainParams, gradient_accumulation, load_params_file

PARAMS_DIR = Path(__file__).resolve().parents[2] / "params"


def param_error(raw: dict, **kwargs) -> str:
    with pytest.raises(ParamError) as excinfo:
        TrainParams.from_dict(raw, **kwargs)
    return str(excinfo.value)


def names(message: str, name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message) is not None


def test_defaults_validate():
    params = TrainParams()
    params.validate()
    assert TrainParams.from_dict({}) == params
    assert params.full_parameter is True


def test_unknown_parameter_suggests_the_close_match():
    message = param_error({"lrr": 0.1})
    assert "'lrr'" in message
    assert "did you mean 'lr'" in message
    message = param_error({"global_bach": 8}, source="params/x.yaml")
    assert "params/x.yaml" in message and "did you mean 'global_batch'" in message


def test_papermill_strings_are_coerced():
    params = TrainParams.from_dict({
        "grad_ckpt": "true", "fp32_loss": "False", "max_steps": "None", "lr": "1e-3", "seq_len": "12",
        "max_grad_norm": "null", "out_dir": "None", "seed": " 7 ", "weight_decay": "0",
    })
    assert params.grad_ckpt is True
    assert params.fp32_loss is False
    assert params.max_steps is None and params.max_grad_norm is None and params.out_dir is None
    assert params.lr == 1e-3 and isinstance(params.lr, float)
    assert params.seq_len == 12 and type(params.seq_len) is int
    assert params.seed == 7
    assert params.weight_decay == 0.0 and isinstance(params.weight_decay, float)
    def overrides(value):
        return TrainParams.from_dict({"kernel_overrides": value})

    assert overrides({"kept_swiglu_layers": "ALL"}).overrides.kept_swiglu_layers == "all"
    assert overrides("{kept_swiglu_layers: '12'}").overrides.kept_swiglu_layers == 12
    assert overrides({"cuda_graphs": False}).kernel_overrides == {"cuda_graphs": "false"}
    assert TrainParams().overrides.cuda_graphs == "auto" and TrainParams().kernel_overrides is None


def test_yaml_typed_values_are_accepted():
    params = TrainParams.from_dict({"lr": 1, "max_steps": 5.0, "bf16": True, "data": Path("some/shard")})
    assert params.lr == 1.0 and isinstance(params.lr, float)
    assert params.max_steps == 5 and type(params.max_steps) is int
    assert params.data == "some/shard"


@pytest.mark.parametrize("name, value", [
    ("seq_len", "twelve"), ("seq_len", 1.5), ("seq_len", True), ("lr", "fast"), ("lr", False),
    ("grad_ckpt", "maybe"), ("grad_ckpt", 2), ("data", 3), ("model", None), ("epochs", "None"),
    ("kernel_overrides", {"kept_swiglu_layers": "some"}), ("kernel_overrides", {"kept_swiglu_layers": 1.5}),
    ("kernel_overrides", ["cuda_graphs"]),
])
def test_wrong_types_name_the_parameter(name, value):
    message = param_error({name: value})
    assert names(message, name), message


@pytest.mark.parametrize("name, value", [
    ("lr", -1e-3), ("lr", 0.0), ("lr", 1e300), ("weight_decay", 2000.0), ("expert_lr_multiplier", 1e5),
    ("lora_lr_multiplier", 20000.0), ("beta1", 1.0), ("beta2", 1.5), ("beta1", -0.1), ("warmup_ratio", 1.0),
    ("warmup_ratio", -0.5), ("device", "tpu"), ("max_steps", -1), ("seq_len", 0), ("epochs", -2),
    ("weight_decay", -0.1), ("max_grad_norm", 0.0), ("eval_every_steps", 0), ("exact_match_limit", -3),
    ("loss_chunk_tokens", 0), ("kernel_overrides", {"kept_swiglu_layers": -1}),
    ("kernel_overrides", {"cflib_adamw": "maybe"}), ("warmup_steps", -2), ("lr_schedule", "cosine_with_restarts"),
    ("min_lr_ratio", 1.5), ("lr_decay_ratio", 2.0), ("adam_epsilon", 0.0), ("adam_epsilon", -1e-8),
    ("adam_epsilon", 1.0), ("adam_epsilon", 1e-30),
])
def test_out_of_range_values_name_the_parameter(name, value):
    message = param_error({name: value})
    assert names(message, name), message


@pytest.mark.parametrize("name", ["lr", "weight_decay", "beta1", "beta2", "warmup_ratio", "max_grad_norm",
                                  "min_lr_ratio", "lr_decay_ratio", "adam_epsilon"])
def test_nan_is_refused(name):
    """`-p weight_decay nan` must not reach the optimizer: NaN is in no valid range."""
    message = param_error({name: "nan"})
    assert names(message, name), message


def test_lora_plus_ratio_is_a_lora_setting_of_at_least_1_whose_rates_stay_bounded():
    lora = {"full_parameter": "false", "init_checkpoint": "some/checkpoint"}
    assert TrainParams.from_dict({**lora, "lora_plus_ratio": "16"}).lora_plus_ratio == 16.0
    message = param_error({"lora_plus_ratio": 16})
    assert names(message, "lora_plus_ratio") and "full_parameter is true" in message
    message = param_error({**lora, "lora_plus_ratio": 0.5})
    assert names(message, "lora_plus_ratio") and "at least 1" in message
    message = param_error({**lora, "lr": 1e-2, "lora_lr_multiplier": 10, "lora_plus_ratio": 200})
    assert "x lora_plus_ratio 200" in message and "learning rate 20" in message


def test_lora_needs_a_base_checkpoint():
    message = param_error({"full_parameter": "false"})
    assert names(message, "full_parameter") and names(message, "init_checkpoint")


def test_lora_parameters_from_papermill_strings_yaml_lists_and_notebooks():
    lora = {"full_parameter": "false", "init_checkpoint": "some/checkpoint"}
    params = TrainParams.from_dict({**lora, "lora_rank": "16", "lora_alpha": "32", "lora_dropout": "0.05",
                                    "lora_targets": "q_proj, v_proj", "base_dtype": "bfloat16", "bf16": "true"})
    assert (params.lora_rank, params.lora_alpha, params.lora_dropout) == (16, 32.0, 0.05)
    assert params.lora_targets == ("q_proj", "v_proj") and params.base_dtype == "bfloat16"
    assert TrainParams.from_dict({**lora, "lora_targets": ["expert_up", "o_proj"]}).lora_targets == (
        "expert_up", "o_proj")
    assert TrainParams.from_dict({**lora, "lora_targets": "[q_proj, 'k_proj']"}).lora_targets == ("q_proj", "k_proj")
    assert TrainParams.from_dict({**lora, "lora_targets": "None"}).lora_targets is None
    assert TrainParams.from_namespace({**lora, "lora_targets": ["k_proj"]}).lora_targets == ("k_proj",)
    assert TrainParams.from_dict({"train_tasks": "uppercase"}).train_tasks == ("uppercase",)
    assert TrainParams.from_dict({**lora, "lora_trainable_tokens": "3-5, 9"}).lora_trainable_tokens == (3, 4, 5, 9)
    assert TrainParams.from_dict({**lora, "lora_trainable_tokens": [7, "10-11"]}).lora_trainable_tokens == (7, 10, 11)
    rslora = TrainParams.from_dict({**lora, "lora_rank": "64", "lora_alpha": "16", "lora_scaling": "rslora"})
    assert rslora.lora_settings().scale == 2.0 and TrainParams.from_dict(lora).lora_settings().scaling == "standard"
    dora = TrainParams.from_dict({**lora, "lora_dora": "true", "lora_targets": "q_proj,v_proj"})
    assert dora.lora_dora is True and dora.lora_settings().dora and not TrainParams.from_dict(lora).lora_settings().dora
    assert TrainParams.from_dict({**lora, "lora_dora": True}).lora_settings().targets == (
        "q_proj", "k_proj", "v_proj", "o_proj", "shared_gate", "shared_up", "shared_down")  # unset: the linear ones


@pytest.mark.parametrize("raw, name", [
    ({"lora_rank": 8}, "lora_rank"), ({"lora_targets": "q_proj"}, "lora_targets"),
    ({"base_dtype": "bfloat16"}, "base_dtype"), ({"lora_dropout": 0.0}, "lora_dropout"),
    ({"lora_scaling": "rslora"}, "lora_scaling"), ({"lora_dora": True}, "lora_dora"),
])
def test_lora_settings_with_full_parameter_training_are_refused(raw, name):
    message = param_error(raw)
    assert names(message, name) and names(message, "full_parameter"), message


@pytest.mark.parametrize("name, value", [("save_every_steps", 4), ("save_total_limit", 2),
                                         ("save_optimizer_state", True)])
def test_checkpoint_settings_without_checkpoints_are_refused(name, value):
    message = param_error({"save_checkpoints": False, name: value})
    assert names(message, name) and names(message, "save_checkpoints"), message


@pytest.mark.parametrize("raw, name", [
    ({"lora_rank": 0}, "lora_rank"), ({"lora_rank": -1}, "lora_rank"), ({"lora_alpha": "nan"}, "lora_alpha"),
    ({"lora_dropout": -0.1}, "lora_dropout"), ({"lora_targets": "q_proj,lm_head"}, "lora_targets"),
    ({"lora_targets": ","}, "lora_targets"), ({"lora_targets": [1, 2]}, "lora_targets"),
    ({"base_dtype": "fp8"}, "base_dtype"), ({"train_tasks": []}, "train_tasks"),
    ({"lora_trainable_tokens": "a-z"}, "lora_trainable_tokens"), ({"lora_trainable_tokens": [3, 3]}, "lora_trainable_tokens"),
    ({"lora_scaling": "rsLoRA"}, "lora_scaling"), ({"lora_scaling": "sqrt"}, "lora_scaling"),
    ({"lora_dora": True, "lora_targets": "q_proj,expert_up"}, "lora_dora"),
])
def test_bad_lora_settings_name_the_parameter(raw, name):
    message = param_error({"full_parameter": False, "init_checkpoint": "c", **raw})
    assert names(message, name), message


def test_rslora_without_an_alpha_is_refused_with_the_alpha_of_a_scale_of_one():
    """Left unset, alpha is the rank: under rsLoRA a scale of sqrt(rank), growing with the rank."""
    message = param_error({"full_parameter": False, "init_checkpoint": "c", "lora_rank": 64, "lora_scaling": "rslora"})
    assert names(message, "lora_alpha") and "sqrt(64) = 8" in message and "lora_alpha: 8 starts" in message, message


def test_impossible_batch_arithmetic_offers_valid_alternatives():
    message = param_error({"global_batch": 100, "micro_batch_per_rank": 32})
    assert names(message, "global_batch")
    assert "96" in message and "128" in message
    micro = re.search(r"micro_batch_per_rank in \[([\d, ]+)\]", message)
    assert micro, message
    options = [int(m) for m in micro.group(1).split(",")]
    assert options and all(100 % m == 0 for m in options)
    for m in options:  # each offered alternative really runs
        TrainParams.from_dict({"global_batch": 100, "micro_batch_per_rank": m})


def test_gradient_accumulation():
    assert gradient_accumulation(64, 8, 2) == 4
    assert gradient_accumulation(32, 32, 1) == 1
    assert gradient_accumulation(96, 4, 3) == 8
    with pytest.raises(ParamError, match="global_batch"):
        gradient_accumulation(64, 8, 3)


def test_from_namespace_takes_the_declared_names_only():
    import os

    class Shell:
        def __call__(self):
            return self

    namespace = {
        "os": os, "math_mod": math, "len": len, "TrainParams": TrainParams, "_": "last output",
        "__name__": "__main__", "_i1": "lr = 1", "In": ["", "lr = 1"], "Out": {1: 2}, "get_ipython": Shell(),
        "exit": Shell(), "lr": "3e-4", "max_steps": 5, "full_parameter": True, "batch": 8, "note": None,
    }
    params = TrainParams.from_namespace(namespace)  # batch and note: the notebook's own variables
    assert params.lr == 3e-4 and params.max_steps == 5


def test_from_namespace_refuses_a_name_papermill_injected_that_is_not_declared():
    namespace = {"In": ["", "lr = 1", "# Parameters\nlrr = 0.1\nmax_steps = 4\n"], "lrr": 0.1, "max_steps": 4}
    message = str(pytest.raises(ParamError, TrainParams.from_namespace, namespace).value)
    assert "notebook parameters: unknown parameter 'lrr' (did you mean 'lr'?)" in message


def test_from_namespace_survives_a_rerun_after_the_whole_notebook():
    # JupyterLab keeps what later cells made: the params object, the run, the record, a bundle path.
    namespace = {"lr": 0.01, "params": TrainParams(), "record": {"eval": {}}, "run": object(), "bundle": "hub"}
    assert TrainParams.from_namespace(namespace).lr == 0.01


def test_repository_parameter_files_validate():
    from cflib.bench.tune import TuneParams

    for path in sorted(PARAMS_DIR.glob("*.yaml")) + sorted(PARAMS_DIR.glob("*.yml")):
        if path.name.startswith("sweep_") and {"grid", "points"} & set(load_params_file(path)):
            continue  # a sweep's own parameters: tests/lab/test_sweep.py
        if path.name.startswith("throughput_"):
            kind = ThroughputParams
        else:  # tune_*: the microbatch tuner's
            kind = TuneParams if path.name.startswith("tune_") else TrainParams
        kind.from_dict(load_params_file(path), source=str(path))  # raises, naming the file


def test_load_params_file(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("lr: 3.0e-4\nmax_steps: null\nbf16: false\nmodel: quickstart\n")
    raw = load_params_file(good)
    assert raw == {"lr": 3e-4, "max_steps": None, "bf16": False, "model": "quickstart"}
    assert TrainParams.from_dict(raw).model == "quickstart"
    empty = tmp_path / "empty.yaml"
    empty.write_text("# only a comment\n")
    assert load_params_file(empty) == {}


@pytest.mark.parametrize("content", [None, "lr: [1e-3\n", "- lr\n- 1e-3\n", "just a string\n"])
def test_load_params_file_errors(tmp_path, content):
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ParamError) as excinfo:
        load_params_file(path)
    assert str(path) in str(excinfo.value)


@pytest.mark.parametrize("raw, expected", [(True, "true"), (False, "false"), ("AUTO", "auto"), (" true ", "true")])
def test_use_custom_kernels_accepts_booleans_and_strings(raw, expected):
    assert TrainParams.from_dict({"use_custom_kernels": raw}).use_custom_kernels == expected


def test_use_custom_kernels_rejects_other_words():
    with pytest.raises(ParamError, match="use_custom_kernels must be one of"):
        TrainParams.from_dict({"use_custom_kernels": "fast"})


def test_every_params_file_is_listed_in_the_parameters_page():
    """docs/parameters.md's table names each params file a user can pass with -f."""
    page = (PARAMS_DIR.parent / "docs" / "parameters.md").read_text()
    unlisted = [path.name for path in sorted(PARAMS_DIR.glob("*.yaml")) if f"(../params/{path.name})" not in page]
    assert not unlisted, f"params files missing from docs/parameters.md's table: {unlisted}"
