"""The throughput measurement and the peer comparison, on CPU at smoke size (figures prove only the plumbing)."""
from __future__ import annotations

import gc

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import cflib.bench.throughput as throughput
from cflib.bench.__main__ import main as report_main
from cflib.bench.comparison import TARGETS, compare
from cflib.bench.peer import PeerTrainer, active_ffn_width, llama_config
from cflib.bench.plots import plot_throughput
from cflib.bench.synthetic import write_random_token_shard
from cflib.bench.tables import TABLES, headline_table, perf_table, update_block
from cflib.bench.throughput import BATCHES, ThroughputParams, flops_per_token, measure, time_steps
from cflib.data.preflight import manifest_findings
from cflib.data.shards import IGNORE_INDEX, open_shard
from cflib.model.config import PRESETS, preset
from cflib.model.lora import LoraSettings, adapter_parameter_count
from cflib.train.params import ParamError, load_params_file
from cflib.train.records import count_parameters

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "measure_throughput.ipynb"
SMOKE = {**load_params_file(ROOT / "params" / "throughput_smoke.yaml")}


SMOKE_PATHS = ["reference", "production", "peer_eager", "peer_liger", "peer_compile", "peer_compile_fa4",
               "peer_compile_fa4_flce", "peer_padded", "peer_packed", "peer_padding_free", "peer_compile_padding_free"]


@pytest.fixture(scope="module")
def smoke_record(tmp_path_factory) -> dict:
    """One smoke measurement of both kinds of batches: every path the CPU can run, and those it cannot. About a
    minute of training on two cores: the tests that read it are in the slow tier."""
    out_dir = tmp_path_factory.mktemp("throughput") / "run"
    params = ThroughputParams.from_dict({**SMOKE, "out_dir": str(out_dir), "paths": SMOKE_PATHS})
    return measure(params, log=lambda line: None)


def entries_of(record: dict, batches: str) -> list[dict]:
    return [e for e in record["paths"] if e["batches"] == batches]


# --- parameters -------------------------------------------------------------------------

def test_parameters_cell_mirrors_throughput_params():
    try:
        from test_notebooks import parameters_cell
    except ImportError:
        from tests.lab.test_notebooks import parameters_cell

    defaults = {name: getattr(ThroughputParams(), name) for name in ThroughputParams.names()}
    cell = parameters_cell(NOTEBOOK)
    assert {name: tuple(v) if isinstance(v, list) else v for name, v in cell.items()} == defaults


@pytest.mark.parametrize("card", ["h100", "h200"])
def test_gpu_params_measure_every_floor_against_the_fastest_peers(card):
    """Each card's run: its peers are the fastest a user of transformers has: Liger on FlashAttention-4,
    torch.compile of the whole model and of the decoder body with Liger's loss, and on realistic lengths the compiled
    model fed padding-free; its set-up and compilation are reported apart, its profile taken at the compared micro-batch."""
    params = ThroughputParams.from_dict(load_params_file(ROOT / "params" / f"throughput_200m_{card}.yaml"))
    assert (params.model, params.seq_len, params.bf16, params.device) == ("tr_hash_200m", 2048, True, "cuda")
    assert params.micro_batches == (16, 48) and params.compare_micro_batch == 16
    assert set(params.batches) == set(BATCHES) and params.shard is None and params.realistic_median_length == 300
    assert {"production", "peer_liger_fa4", "peer_compile_fa4", "peer_compile_fa4_flce", "peer_padding_free",
            "peer_compile_padding_free"} <= set(params.paths)
    assert params.compile_backend == "inductor" and params.profile_steps > 0
    assert params.ceiling_size == 8192 and params.warmup_steps >= 3 and params.timed_steps >= 8


def test_smoke_params_run_the_realistic_batches_on_a_cpu():
    params = ThroughputParams.from_dict(SMOKE)
    assert params.device == "cpu" and "realistic" in params.batches and params.seq_len <= 128
    assert {"peer_padded", "peer_packed", "peer_padding_free"} <= set(params.paths) and not params.fed_peers_liger


@pytest.mark.parametrize("raw, expected", [("16,32", (16, 32)), ("[16, 32]", (16, 32)), ([8], (8,)), (4, (4,))])
def test_micro_batches_accept_yaml_lists_and_papermill_strings(raw, expected):
    params = ThroughputParams.from_dict({"micro_batches": raw, "compare_micro_batch": expected[0]})
    assert params.micro_batches == expected


@pytest.mark.parametrize("raw, message", [
    ({"micro_batch": [2]}, "unknown parameter 'micro_batch'"),
    ({"micro_batches": [2, 4], "compare_micro_batch": 16}, "compare_micro_batch 16 is not one of"),
    ({"micro_batches": [2, 2]}, "micro_batches repeats"),
    ({"micro_batches": [0], "compare_micro_batch": 0}, "micro_batches must be one or more positive"),
    ({"micro_batches": "two"}, "micro_batches must be an integer"),
    ({"paths": "reference,peer_fast"}, "'peer_fast' is not a path"),
    ({"paths": []}, "name at least one"),
    ({"model": "tr_hash_2b"}, "unknown preset 'tr_hash_2b'"),
    ({"seq_len": 4096}, "exceeds model smoke's max_position_embeddings"),
    ({"timed_steps": 0}, "timed_steps must be positive"),
    ({"device": "tpu"}, "device must be one of"),
    ({"batches": "random_rows,packed"}, "batches: name one or more of"),
    ({"batches": []}, "batches: name one or more of"),
    ({"batches": "realistic", "paths": "peer_liger"}, "batches: realistic runs .* paths names none of them"),
    ({"batches": "random_rows", "paths": "peer_padded"}, "batches: random_rows runs .* paths names none"),
    ({"realistic_median_length": 32}, "realistic_median_length 32 must be below seq_len 32"),
    ({"realistic_median_length": 0}, "realistic_median_length must be positive"),
    ({"batches": "random_rows", "shard": "outputs/data"}, "shard 'outputs/data' is read by the realistic"),
    ({"shard": "/nonexistent/shard"}, "shard: /nonexistent/shard holds no train/ partition"),
])
def test_bad_parameters_name_the_culprit(raw, message):
    with pytest.raises(ParamError, match=message):
        ThroughputParams.from_dict(raw)


def test_out_dir_holding_a_record_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "record.json").write_text("{}")
    with pytest.raises(ParamError, match="already holds a throughput record"):
        measure(ThroughputParams(out_dir=str(tmp_path)), log=lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


@pytest.mark.parametrize("name", sorted(throughput.VARIANT_PATHS))
def test_each_variant_is_production_with_its_switches_and_they_are_valid(name, tmp_path):
    """A variant is measured only when named (no default run trains it): its settings must still validate, and
    differ from production's by the switches its name says."""
    def settings(kernels: dict) -> dict:
        run = throughput.train_params(ThroughputParams(), 2, 1, tmp_path, tmp_path / "run", kernels)
        return {field: getattr(run, field) for field in run.names()}

    production = settings(throughput.PROJECT_PATHS["production"])
    changed = {k: v for k, v in settings(throughput.VARIANT_PATHS[name]).items() if v != production[k]}
    expected = {"production_every_row": set(), "production_loss_chunk_4096": {"loss_chunk_tokens"}}
    assert set(changed) == expected.get(name, {"kernel_overrides"})
    if "kernel_overrides" in changed:
        switches = changed["kernel_overrides"]
        assert switches and all(value in ("false", 0) for value in switches.values())
    assert name not in throughput.DEFAULT_PATHS


# --- the measured quantities ------------------------------------------------------------

def test_flops_per_token_is_the_documented_count_for_both_sides():
    config = preset("tr_hash_200m")
    assert flops_per_token(config.active_parameters(), 16, 896, 2048) == 1_350_296_832
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        peer = LlamaForCausalLM(llama_config(config))
    peer_params = count_parameters(peer)["params_trainable"]  # the tied head counted once
    assert peer_params == 195_687_296
    # The count of docs/measuring.md#measurement-protocol reproduces a measured peer row (eager transformers
    # Llama, 16 x 2,048 tokens, one H200): 172,219 tokens/s at 232.5 model TFLOP/s.
    assert 172_219 * flops_per_token(peer_params, 16, 896, 2048) / 1e12 == pytest.approx(232.5, abs=0.05)


def test_peer_has_the_project_models_active_width():
    config = preset("tr_hash_200m")
    llama = llama_config(config)
    assert active_ffn_width(config) == 3200 == llama.intermediate_size
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.vocab_size, llama.tie_word_embeddings) == (16, 896, 14, 2, 32000, True)
    assert llama._attn_implementation == "sdpa"


def test_random_token_shard_follows_the_protocol(tmp_path):
    root = write_random_token_shard(tmp_path / "shard", vocab_size=260, seq_len=30, train_rows=6, eval_rows=2, seed=0)
    shard = open_shard(root, "train", vocab_size=260, seq_len=30, verify_hashes=True)
    assert len(shard) == 6 and len(open_shard(root, "eval")) == 2
    rows = [shard[i] for i in range(6)]
    for ids, labels in rows:
        assert ids.numel() == 30 and int(ids[:-1].min()) >= 1 and ids[-1] == 0  # the EOS id ends it alone
        assert (labels[:10] == IGNORE_INDEX).all()  # the first third is unsupervised
        assert torch.equal(labels[10:-1], ids[11:])  # causally aligned targets
    assert not torch.equal(rows[0][0], rows[1][0])  # fresh rows, not one repeated
    assert manifest_findings(shard, 260) == []  # a whole example each: measuring warns of nothing


def test_time_steps_excludes_warmup_from_the_steady_state(monkeypatch):
    clock = iter([0.0, 5.0, 5.0, 6.0, 6.0, 8.0])  # a 5 s warm-up step, then steps of 1 s and 2 s
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    gc.disable()  # an automatic collection would read the clock too
    try:
        result = time_steps(lambda batch, following: {"tokens": 100, "supervised_tokens": 60, "loss": 1.0},
                            [np.arange(2)] * 3, warmup_steps=1, device=torch.device("cpu"))
    finally:
        gc.enable()
    assert result["tokens_per_s"] == 200 / 3 and result["supervised_tokens_per_s"] == 120 / 3
    assert result["warmup_s"] == 5.0 and result["step_seconds"] == [1.0, 2.0]
    assert result["warmup_step_seconds"] == [5.0] and result["warmup_compile_s"] == result["timed_compile_s"] == 0
    assert result["collector_pause_s"] == [0, 0]
    assert result["gpu_clock_mhz"] == result["gpu_power_w"] == [None, None]  # no GPU, no NVML reading


def test_time_steps_tells_each_step_the_next_batch():
    told = []
    time_steps(lambda batch, following: told.append((int(batch[0]), following if following is None else
                                                     int(following[0]))) or {"tokens": 1, "supervised_tokens": 1,
                                                                             "loss": 0.0},
               [np.array([k]) for k in range(3)], warmup_steps=1, device=torch.device("cpu"))
    assert told == [(0, 1), (1, 2), (2, None)]


def test_time_steps_records_each_steps_collector_pauses_with_the_setup_frozen(collector_unfrozen):
    frozen = []

    def step(batch: np.ndarray, following: np.ndarray | None) -> dict:
        frozen.append(gc.get_freeze_count())
        if batch[0] == 2:  # this step makes a cycle and collects it
            cycle = [[]]
            cycle[0].append(cycle)
            del cycle
            gc.collect()
        return {"tokens": 1, "supervised_tokens": 1, "loss": 0.0}

    result = time_steps(step, [np.array([k]) for k in range(4)], warmup_steps=1, device=torch.device("cpu"))
    paused = result["collector_pause_s"]
    assert len(paused) == 3 and paused[1] > 0 and paused[1] <= result["step_seconds"][1]
    assert all(count > 0 for count in frozen) and gc.get_freeze_count() == 0  # frozen while timed, then back


def test_matmul_ceiling_counts_two_n_cubed_flops(monkeypatch):
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    result = throughput.matmul_ceiling(torch.device("cpu"), size=64, repeats=4)
    assert result["tflops_per_s"] == 2 * 64**3 * 4 / 2.0 / 1e12 and result["dtype"] == "bfloat16"


def test_the_sustained_ceiling_runs_for_its_seconds_after_as_long_a_warm_up():
    started = time.perf_counter()
    result = throughput.sustained_matmul_ceiling(torch.device("cpu"), size=32, seconds=0.05, dtype=torch.float32)
    assert time.perf_counter() - started >= 0.1 and result["seconds"] >= 0.05 and result["warmup_s"] == 0.05
    assert result["repeats"] % 8 == 0 and result["tflops_per_s"] == pytest.approx(
        2 * 32**3 * result["repeats"] / result["seconds"] / 1e12)
    assert result["gpu_clock_mhz"] is None and result["gpu_power_w"] is None


def test_entries_carry_their_utilisation_of_the_sustained_ceiling(tmp_path):
    record = measure(ThroughputParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "run"), "micro_batches": [2],
                                                 "batches": "random_rows", "paths": ["reference"],
                                                 "ceiling_sustained_s": 0.05}), log=lambda line: None)
    sustained, (entry,) = record["matmul_ceiling_sustained"], record["paths"]
    assert entry["mfu_sustained"] == entry["model_tflops_per_s"] / sustained["tflops_per_s"]
    assert "sustained for" in headline_table(record)


# --- one smoke run ----------------------------------------------------------------------

@pytest.mark.slow
def test_record_carries_the_measurement_protocol(smoke_record):
    record = smoke_record
    for field in ("framework", "device", "vocab_size", "seq_len", "batch_per_rank", "precision", "grad_ckpt",
                  "loss_chunk_tokens", "telemetry", "compilation", "timing_protocol", "matmul_ceiling"):
        assert field in record, field
    assert record["framework"]["torch"] == torch.__version__ and "cflib_commit" in record["framework"]
    assert record["framework"]["transformers"] and "liger_kernel" in record["framework"]
    assert record["device"]["type"] == "cpu" and record["device"]["count"] == 1
    protocol = record["timing_protocol"]
    assert protocol["warmup_steps_excluded"] == 1 and protocol["timed_steps"] == 2
    assert protocol["includes_eval"] is False and protocol["includes_checkpoint_io"] is False
    assert record["matmul_ceiling"]["tflops_per_s"] > 0
    assert json.loads((Path(record["out_dir"]) / "record.json").read_text()) == json.loads(json.dumps(record))
    assert not (Path(record["out_dir"]) / "progress.json").exists()  # the record replaces it
    assert record["batches"] == ["random_rows", "realistic"] and set(protocol["data"]) == set(BATCHES)


@pytest.mark.slow
def test_every_path_is_measured_on_its_batches(smoke_record):
    dense = ("reference", "production", "peer_eager", "peer_liger", "peer_compile", "peer_compile_fa4",
             "peer_compile_fa4_flce")
    realistic = ("reference", "production", "peer_padded", "peer_packed", "peer_padding_free",
                 "peer_compile_padding_free")
    assert [(e["batches"], e["path"], e["micro_batch"]) for e in smoke_record["paths"]] == [
        ("random_rows", name, micro) for name in dense for micro in (1, 2)] + [
        ("realistic", name, 2) for name in realistic]  # realistic lengths at the compared micro-batch
    for entry in smoke_record["paths"]:
        if entry["status"] != "ok":
            continue
        assert entry["tokens_per_s"] > 0 and entry["supervised_tokens_per_s"] > 0
        assert 0 < len(entry["step_seconds"]) < entry["steps"]  # warm-up excluded
        assert len(entry["step_seconds"]) == 2 or entry["path"] == "peer_padded"
        assert all(math.isfinite(loss) for loss in entry["losses"]) and len(entry["losses"]) == entry["steps"]
        assert entry["mfu"] == entry["model_tflops_per_s"] / smoke_record["matmul_ceiling"]["tflops_per_s"]
        assert entry["peak_memory_gib"] is None and entry["memory_at_start_gib"] is None  # not measured on CPU
        for field in ("kernel_path", "params_total", "params_trainable", "model_flops_per_token", "precision",
                      "loss_precision", "grad_ckpt", "compiled"):
            assert field in entry, (entry["path"], field)


@pytest.mark.slow
def test_project_paths_train_through_the_trainer_and_read_kernels_back(smoke_record):
    from cflib.model.decoder import TRMoEModel

    reference = [e for e in entries_of(smoke_record, "random_rows") if e["path"] == "reference"]
    assert [e["status"] for e in reference] == ["ok", "ok"]
    model = TRMoEModel(preset("smoke"))
    model(torch.zeros(1, 2, dtype=torch.long))  # the keys a forward reads back
    # the model's, what stepped, and how the plain GEMMs ran
    assert set(reference[0]["kernel_path"]) == {*model.kernel_path(), "optimizer", "gemms"}
    assert reference[0]["kernel_path"]["optimizer"] in ("torch", "torch_fused")  # cflib_adamw is off
    assert reference[0]["kernel_path"]["gemms"] == "torch"  # quack_gemms needs cflib's path
    assert reference[0]["kernel_path"]["moe"] != "none"  # set by a forward that ran, not by construction
    assert reference[0]["requested"] == {"use_custom_kernels": "false", "require_liger": False,
                                         "pack_sequences": False}
    assert reference[0]["params_trainable"] == preset("smoke").num_parameters()
    production = [e for e in smoke_record["paths"] if e["path"] == "production"]
    # on CPU the release kernels either refuse (skipped, with the reason) or run: never a crash
    assert all(e["status"] in ("ok", "skipped") for e in production)
    assert all(e["reason"] for e in production if e["status"] == "skipped")


@pytest.mark.slow
def test_realistic_lengths_train_the_release_layout_with_document_masking(smoke_record):
    project = {e["path"]: e for e in entries_of(smoke_record, "realistic") if e["path"] in ("reference", "production")}
    assert project["reference"]["status"] == "ok" and project["reference"]["requested"]["pack_sequences"] is True
    for entry in project.values():
        if entry["status"] == "ok":  # the backend the model ran, read back: a document mask, not plain causal
            assert entry["kernel_path"]["attention"] in ("sdpa_mask", "flex_attention") or "varlen" in \
                entry["kernel_path"]["attention"]
    dense_reference = entries_of(smoke_record, "random_rows")[0]
    assert dense_reference["kernel_path"]["attention"] == "torch_sdpa"


@pytest.mark.slow
def test_every_realistic_path_trains_the_same_examples(smoke_record):
    """Timed supervised and example tokens are the same for every path: the same examples, however fed."""
    source = smoke_record["realistic"]
    assert source["median"] == 10 and source["generated"] and source["timed_examples"] > 0
    ran = [e for e in entries_of(smoke_record, "realistic") if e["status"] == "ok"]
    assert {e["path"] for e in ran} >= {"reference", "peer_padded", "peer_packed"}
    for entry in ran:
        seconds = sum(entry["step_seconds"])
        assert round(entry["supervised_tokens_per_s"] * seconds) == source["timed_supervised_tokens"], entry["path"]
        assert round(entry["real_tokens_per_s"] * seconds) == source["timed_example_tokens"], entry["path"]
        assert entry["model_flops_per_token"] > 0
    by_path = {e["path"]: e for e in ran}
    padded, packed = by_path["peer_padded"], by_path["peer_packed"]
    assert padded["steps"] > packed["steps"] == 3  # the same examples, micro-batch examples a step
    assert padded["requested"]["micro_batch_counts"] == "examples" and "padded" in padded["feed"]
    assert "wrapped" in packed["feed"] and packed["kernel_path"]["attention"] == "sdpa"
    # the same windows, fed by position: the peer on positions fed, the project on the same count
    assert packed["tokens_per_s"] * sum(packed["step_seconds"]) == pytest.approx(
        by_path["reference"]["tokens_per_s"] * sum(by_path["reference"]["step_seconds"]))


@pytest.mark.slow
def test_padding_free_is_skipped_without_a_varlen_kernel_with_its_reason(smoke_record):
    for name in ("peer_padding_free", "peer_compile_padding_free"):
        entry = next(e for e in smoke_record["paths"] if e["path"] == name)
        assert entry["status"] == "skipped" and "varlen attention kernel" in entry["reason"]
        assert "cpu" in entry["reason"]


@pytest.mark.slow
def test_every_path_reports_its_start_up_apart_from_the_steady_state(smoke_record):
    """Set-up, first step, the warm-up beyond steady state and torch.compile's own work, for theirs and ours."""
    ran = [e for e in smoke_record["paths"] if e["status"] == "ok"]
    for entry in ran:
        start = entry["startup"]
        assert start["setup_s"] > 0 and start["first_step_s"] == entry["warmup_step_seconds"][0] > 0
        assert start["warmup_beyond_steady_s"] == pytest.approx(
            entry["warmup_s"] - len(entry["warmup_step_seconds"]) * float(np.median(entry["step_seconds"])))
        assert start["compile_s"] == pytest.approx(entry["warmup_compile_s"] + entry["timed_compile_s"])
    compiled = [e for e in ran if e["path"] == "peer_compile"]
    assert compiled and all(e["startup"]["graphs"] > 0 and e["startup"]["compile_s"] > 0 for e in compiled)
    assert all(e["startup"]["graphs"] == 0 for e in ran if e["path"] in ("reference", "peer_eager"))
    header = "| path | micro-batch | set-up s | first step s | warm-up beyond steady s | torch.compile s |"
    startup_table = perf_table(smoke_record).split(header)[1]
    row = next(line for line in startup_table.splitlines() if line.startswith("| peer_compile | 2 |"))
    assert row.endswith(f"| {compiled[1]['startup']['graphs']} | {compiled[1]['startup']['graph_breaks']} |")


@pytest.mark.slow
def test_evaluation_and_checkpoint_are_timed_apart_and_the_checkpoint_removed(smoke_record):
    timed = [e for e in smoke_record["paths"] if "evaluation_and_checkpoint" in e]
    assert {(e["batches"], e["path"], e["micro_batch"]) for e in timed} <= {
        ("random_rows", "reference", 2), ("random_rows", "production", 2)}
    io = next(e for e in timed if e["path"] == "reference")["evaluation_and_checkpoint"]
    assert io["status"] == "ok" and io["eval_examples"] == 8 and io["eval_s"] > 0 and io["first_eval_s"] > 0
    assert io["checkpoint_bytes"] > preset("smoke").num_parameters() * 4  # fp32 weights at least
    shown = f"one full evaluation (8 examples) {io['eval_s']:.2f} s (the first, with its first calls, "
    assert shown + f"{io['first_eval_s']:.2f} s)" in perf_table(smoke_record)
    assert not list(Path(smoke_record["out_dir"]).rglob("model.safetensors"))


@pytest.mark.slow
def test_profiles_are_taken_after_the_timed_steps_at_the_compared_micro_batch(smoke_record):
    profiled = [e for e in smoke_record["paths"] if "profile" in e]
    assert {(e["batches"], e["path"], e["micro_batch"]) for e in profiled} == {
        (e["batches"], e["path"], 2) for e in smoke_record["paths"] if e["status"] == "ok"}
    profile = profiled[0]["profile"]
    assert profile["status"] == "ok" and profile["steps"] == 1 and profile["top_ms"]
    assert "Self CPU" in Path(profile["table"]).read_text()
    assert "Input Shapes" in Path(profile["table_by_shape"]).read_text()
    assert len(profiled[0]["step_seconds"]) == 2  # the profiled step is not among the timed ones


@pytest.mark.slow
def test_peers_train_and_liger_is_skipped_on_cpu_with_its_reason(smoke_record):
    by_path = {}
    for entry in entries_of(smoke_record, "random_rows"):
        by_path.setdefault(entry["path"], []).append(entry)
    eager = by_path["peer_eager"][0]
    assert eager["status"] == "ok" and eager["compiled"] is False
    assert eager["kernel_path"]["rmsnorm"] == "LlamaRMSNorm" and "ForCausalLMLoss" in eager["kernel_path"]["loss"]
    assert eager["peer_config"]["intermediate_size"] == active_ffn_width(preset("smoke"))
    compiled = by_path["peer_compile"]
    assert [e["status"] for e in compiled] == ["ok", "ok"] and compiled[0]["compiled"] == "eager"
    for entry in by_path["peer_liger"]:
        assert entry["status"] == "skipped" and "CUDA" in entry["reason"]
    for entry in by_path["peer_compile_fa4"] + by_path["peer_compile_fa4_flce"]:  # FlashAttention-4 is CUDA's
        assert entry["status"] == "skipped" and "flash_attention_4 needs a CUDA device" in entry["reason"]


@pytest.mark.parametrize("target, module", [("model", "OptimizedModule"), ("decoder", "LlamaForCausalLM")])
def test_a_compiled_peer_trains_compiled_whole_or_its_decoder_body(tmp_path, target, module):
    """HF Trainer's torch_compile compiles the whole model; the decoder body compiled in place leaves the head and
    loss eager (where Liger's fused loss runs) and the state dict as it was."""
    from cflib.bench.peer import build_llama
    from cflib.bench.sessions import _compiled_as, compiled

    root = write_random_token_shard(tmp_path / "shard", vocab_size=260, seq_len=24, train_rows=2, eval_rows=1, seed=3)
    params = throughput.train_params(ThroughputParams(), 2, 2, root, tmp_path / "run", {})
    model = build_llama(preset("smoke"), torch.device("cpu"), seed=0)
    keys = set(model.state_dict())
    try:
        trainer = PeerTrainer(model, params, torch.device("cpu"), open_shard(root, "train"), 2, "eager", target)
        rows = [trainer.train_step(np.arange(2)) for _ in range(2)]
        assert type(trainer.train_model).__name__ == module and compiled(trainer.train_model)
        assert _compiled_as(trainer, "eager") == ("eager" if target == "model" else "eager (decoder body)")
        assert compiled(model.model) == (target == "decoder") and set(model.state_dict()) == keys
        assert all(math.isfinite(row["loss"]) for row in rows) and rows[1]["loss"] != rows[0]["loss"]
    finally:
        torch._dynamo.reset()
    uncompiled = PeerTrainer(build_llama(preset("smoke"), torch.device("cpu"), seed=0), params, torch.device("cpu"),
                             open_shard(root, "train"), 2)
    assert not compiled(uncompiled.train_model) and _compiled_as(uncompiled, None) is False


def test_fed_peers_with_liger_are_skipped_on_cpu_with_its_reason(tmp_path):
    record = measure(ThroughputParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "run"), "batches": "realistic",
                                                 "paths": ["peer_packed"], "fed_peers_liger": True}),
                     log=lambda line: None)
    [entry] = record["paths"]
    assert entry["status"] == "skipped" and "Liger" in entry["reason"] and "CUDA" in entry["reason"]


def test_liger_patches_are_read_back_and_undone_for_the_next_peer(monkeypatch):
    """Patching needs no GPU (running the kernels does): check the read-back and the restored globals."""
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    from cflib.bench import peer

    plain = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP,
             modeling_llama.LlamaForCausalLM.forward)
    monkeypatch.setattr(peer, "check_liger", lambda device: None)
    model = peer.build_llama(preset("smoke"), torch.device("cpu"), seed=0)
    with peer.liger_applied(model, torch.device("cpu")):
        path = peer.peer_kernel_path(model)
    assert (path["rmsnorm"], path["swiglu"], path["loss"]) == (
        "LigerRMSNorm", "LigerSwiGLUMLP", "liger_fused_linear_cross_entropy")
    assert path["rope"].startswith("liger_kernel.")
    assert plain == (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP,
                     modeling_llama.LlamaForCausalLM.forward)
    after = peer.peer_kernel_path(peer.build_llama(preset("smoke"), torch.device("cpu"), seed=0))
    assert after["rmsnorm"] == "LlamaRMSNorm" and "ForCausalLMLoss" in after["loss"]
    assert after["rope"].startswith("transformers.models.llama.modeling_llama.")


def test_liger_s_loss_alone_leaves_the_decoder_plain(monkeypatch):
    """The compiled decoder body's peer takes Liger's fused linear cross-entropy alone: the body stays transformers'
    (torch.compile fuses it), the loss is Liger's, and everything is put back after."""
    pytest.importorskip("liger_kernel")
    from cflib.bench import peer

    monkeypatch.setattr(peer, "check_liger", lambda device: None)
    model = peer.build_llama(preset("smoke"), torch.device("cpu"), seed=0)
    with peer.liger_applied(model, torch.device("cpu"), "loss"):
        path = peer.peer_kernel_path(model)
    assert (path["rmsnorm"], path["swiglu"], path["loss"]) == ("LlamaRMSNorm", "LlamaMLP",
                                                               "liger_fused_linear_cross_entropy")
    assert path["rope"].startswith("transformers.models.llama.modeling_llama.")
    with pytest.raises(ValueError, match="kernels must be one of"):
        with peer.liger_applied(model, torch.device("cpu"), "norms"):
            pass


def test_a_function_is_named_plain_or_as_the_module_standing_for_it():
    """transformers 5.25+ wraps its Llama RoPE in a `kernels` function module: a module, named by its layer."""
    from cflib.bench.peer import function_name

    class Func(torch.nn.Module):  # as kernels' _create_func_module makes them
        kernel_layer_name = "rotary_pos_emb"

    Func.__module__ = "transformers.models.llama.modeling_llama"
    assert function_name(math.sqrt) == "math.sqrt"
    assert function_name(Func()) == "transformers.models.llama.modeling_llama.rotary_pos_emb (function module)"


def test_peer_loss_matches_the_projects_token_mean(tmp_path):
    """The peer's loss is a sum over supervised tokens over their count, on causally aligned labels."""
    root = write_random_token_shard(tmp_path / "shard", vocab_size=260, seq_len=24, train_rows=2, eval_rows=1, seed=3)
    data = open_shard(root, "train")
    params = throughput.train_params(ThroughputParams(), 2, 1, root, tmp_path / "run", {})
    from cflib.bench.peer import build_llama

    model = build_llama(preset("smoke"), torch.device("cpu"), seed=0)
    ids, labels = (torch.stack(t) for t in zip(*(data[i] for i in range(2))))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    row = PeerTrainer(model, params, torch.device("cpu"), data, total_steps=1).train_step(np.arange(2))
    assert row["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert row["supervised_tokens"] == int((labels != IGNORE_INDEX).sum()) and row["tokens"] == 48


def test_a_path_whose_requirements_fail_is_skipped_with_the_reason(tmp_path, monkeypatch):
    real_prepare = throughput.prepare

    def prepare(params):
        if params.use_custom_kernels == "true":
            raise ParamError("use_custom_kernels: true but the TR-MoE Triton kernels need a CUDA device")
        return real_prepare(params)

    monkeypatch.setattr(throughput, "prepare", prepare)
    record = measure(ThroughputParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "run"), "micro_batches": [2],
                                                 "batches": "random_rows", "paths": ["reference", "production"]}),
                     log=lambda line: None)
    reference, production = record["paths"]
    assert reference["status"] == "ok"
    assert production["status"] == "skipped" and "need a CUDA device" in production["reason"]
    row = next(r for r in record["comparison"] if r["numerator"] == "production" and r["denominator"] == "best_peer")
    assert row["value"] is None and "need a CUDA device" in row["why_none"]


@pytest.mark.slow
def test_lora_paths_train_adapters_on_the_production_kernels_and_are_compared(tmp_path):
    """production_lora and production_dora against production (smoke size: the plumbing); LoRA's BF16 base needs
    bf16 and says so."""
    record = measure(ThroughputParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "run"), "micro_batches": [2],
                                                 "paths": ["production", "production_lora",
                                                           "production_lora_bf16_base", "production_dora"],
                                                 "profile_steps": 0, "batches": ["random_rows"]}),
                     log=lambda line: None)
    full, lora, bf16_base, dora = record["paths"]
    assert full["status"] == lora["status"] == dora["status"] == "ok", [p.get("reason") for p in record["paths"]]
    assert lora["kernel_path"]["moe"] == "triton_fused" and lora["params_trainable"] < lora["params_total"] / 2
    config = PRESETS[SMOKE["model"]]
    assert dora["params_trainable"] == adapter_parameter_count(config, LoraSettings(rank=16, alpha=32, dora=True))
    assert full["params_trainable"] == full["params_total"]
    assert lora["evaluation_and_checkpoint"]["status"] == "ok"
    assert bf16_base["status"] == "skipped" and "bf16" in bf16_base["reason"]
    rows = [r for r in record["comparison"] if r["numerator"] == "production_lora"]
    assert [(r["quantity"], r["target"]) for r in rows] == [("tokens_per_s", ">= 0.90"), ("peak_memory_gib", "<= 1.00")]
    assert rows[0]["value"] == lora["tokens_per_s"] / full["tokens_per_s"]
    assert "| production_lora | 2 |" in perf_table(record)  # what the notebook shows of it
    plot_throughput(record, save_to=tmp_path / "throughput.png")
    assert (tmp_path / "throughput.png").is_file()


def test_out_of_memory_is_recorded_and_the_next_path_runs(tmp_path, monkeypatch):
    def out_of_memory(self, step_examples, next_examples=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(PeerTrainer, "train_step", out_of_memory)
    record = measure(ThroughputParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "run"), "micro_batches": [2],
                                                 "batches": "random_rows", "paths": ["peer_eager", "reference"]}),
                     log=lambda line: None)
    peer, reference = record["paths"]
    assert peer["status"] == "oom" and "Tried to allocate" in peer["reason"]
    assert reference["status"] == "ok"


def test_a_run_cut_short_leaves_what_it_measured(tmp_path, monkeypatch):
    real_measure_path = throughput.measure_path

    def measure_path(name, *args):
        if name == "peer_eager":
            raise KeyboardInterrupt  # as a time limit stops a run
        return real_measure_path(name, *args)

    monkeypatch.setattr(throughput, "measure_path", measure_path)
    out_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        measure(ThroughputParams.from_dict({**SMOKE, "out_dir": str(out_dir), "micro_batches": [2],
                                            "batches": "random_rows", "paths": ["reference", "peer_eager"]}),
                log=lambda line: None)
    progress = json.loads((out_dir / "progress.json").read_text())
    assert [(e["path"], e["status"]) for e in progress["paths"]] == [("reference", "ok")]
    assert not (out_dir / "record.json").exists()


@pytest.mark.slow
def test_repetitions_run_round_robin_and_each_entry_is_its_fastest(tmp_path, monkeypatch):
    order = []
    real_measure_path = throughput.measure_path

    def measure_path(name, micro, params, device, config, batches, out_dir, repetition=0):
        order.append((name, repetition))
        entry = real_measure_path(name, micro, params, device, config, batches, out_dir, repetition)
        # The second wins by far more than a CPU's timing can move (workers sharing two cores slow a step 2x).
        return {**entry, "tokens_per_s": entry["tokens_per_s"] * (1000 if repetition == 1 else 1)}

    monkeypatch.setattr(throughput, "measure_path", measure_path)
    record = measure(ThroughputParams.from_dict({**SMOKE, "out_dir": str(tmp_path / "run"), "micro_batches": [2],
                                                 "batches": "random_rows", "paths": ["reference", "peer_eager"],
                                                 "repetitions": 2}), log=lambda line: None)
    assert order == [("reference", 0), ("peer_eager", 0), ("reference", 1), ("peer_eager", 1)]
    assert record["timing_protocol"]["repetitions"].startswith("2: ")
    for entry in record["paths"]:
        tried = entry["repetitions"]
        assert [r["repetition"] for r in tried] == [0, 1] and entry["repetition"] == 1
        assert entry["tokens_per_s"] == max(r["tokens_per_s"] for r in tried)
        assert all(r["status"] == "ok" and len(r["step_seconds"]) == 2 for r in tried)
    timed_apart = [e for e in record["paths"] if e["path"] == "reference"][0]
    assert "checkpoint_save_s" in json.dumps(timed_apart["evaluation_and_checkpoint"])  # the first repetition's


def test_best_of_repetitions_keeps_a_failure_only_when_nothing_ran():
    ran = {"batches": "random_rows", "path": "reference", "micro_batch": 2, "status": "ok", "tokens_per_s": 5.0}
    failed = {**ran, "status": "failed", "tokens_per_s": None}
    other = {**failed, "path": "production"}
    best = throughput.best_of_repetitions([failed, ran, other, other])
    assert [(e["path"], e["status"]) for e in best] == [("reference", "ok"), ("production", "failed")]
    assert [r["status"] for r in best[0]["repetitions"]] == ["failed", "ok"]


# --- the comparison ---------------------------------------------------------------------

def _entry(path: str, micro: int, tokens_per_s: float, peak: float | None = 10.0, batches: str = "random_rows",
           supervised: float | None = None, tflops: float | None = None) -> dict:
    return {"path": path, "batches": batches, "micro_batch": micro, "status": "ok", "tokens_per_s": tokens_per_s,
            "supervised_tokens_per_s": supervised, "peak_memory_gib": peak, "model_tflops_per_s": tflops}


def test_compare_takes_the_products_targets_from_one_run():
    """Every floor is against the fastest peer of the run: at each micro-batch on random rows, and on realistic
    lengths the fed peer with the most supervised tokens/s (a padded peer's tokens/s count its padding)."""
    entries = [_entry("reference", 16, 100.0, 36.0), _entry("production", 16, 400.0, 16.0, tflops=500.0),
               _entry("production", 32, 440.0, 30.0, tflops=550.0), _entry("peer_liger_fa4", 16, 250.0, 22.5),
               _entry("peer_liger_fa4", 32, 330.0, 42.0), _entry("peer_compile_fa4", 16, 300.0, 24.0),
               _entry("peer_compile_fa4_flce", 16, 290.0, 19.0), _entry("peer_compile_fa4_flce", 32, 320.0, 40.0),
               {"path": "peer_compile_fa4", "batches": "random_rows", "micro_batch": 32, "status": "oom",
                "reason": "CUDA out of memory"},
               _entry("production", 16, 420.0, 14.0, "realistic", supervised=200.0),
               _entry("peer_packed", 16, 380.0, 20.0, "realistic", supervised=100.0),
               _entry("peer_padded", 16, 900.0, 30.0, "realistic", supervised=20.0),
               _entry("peer_padding_free", 16, 300.0, 18.0, "realistic", supervised=140.0),
               _entry("peer_compile_padding_free", 16, 320.0, 24.0, "realistic", supervised=160.0),
               _entry("peer_liger", 16, 999.0, 1.0, "realistic")]  # not a random-rows peer: never best_peer there
    rows = {(r["quantity"], r["micro_batch"], r["denominator"], r["numerator_batches"]): r
            for r in compare(entries, 16, {"tflops_per_s": 800.0})}
    assert len(rows) == len(TARGETS) == 5
    assert {r["denominator"] for r in rows.values()} == {"best_peer", "ceiling"}
    at_16 = rows["tokens_per_s", 16, "best_peer", "random_rows"]  # the fastest peer at 16: compiled whole here
    assert at_16["value"] == 400 / 300 and at_16["denominator_entry"] == "peer_compile_fa4 mb16"
    assert at_16["target"] == ">= 1.30" and at_16["met"]
    memory = rows["peak_memory_gib", 16, "best_peer", "random_rows"]  # against that same peer's memory
    assert memory["value"] == 16.0 / 24.0 and memory["met"] and memory["target"] == "<= 0.90"
    best = rows["tokens_per_s", "best", "best_peer", "random_rows"]  # each side at its fastest micro-batch
    assert best["value"] == 440 / 330 and best["numerator_entry"] == "production mb32" and best["met"]
    assert best["denominator_entry"] == "peer_liger_fa4 mb32" and best["target"] == ">= 1.25"
    realistic = rows["supervised_tokens_per_s", 16, "best_peer", "realistic"]  # the compiled padding-free peer
    assert realistic["value"] == 200 / 160 and not realistic["met"] and realistic["target"] == ">= 1.30"
    assert realistic["denominator_entry"] == "peer_compile_padding_free mb16"
    assert realistic["denominator_batches"] == "realistic"
    ceiling = rows["model_tflops_per_s", "best", "ceiling", "random_rows"]
    assert ceiling["value"] == 550 / 800 and ceiling["met"] and ceiling["target"] == ">= 0.60"
    assert ceiling["denominator_entry"] == "bf16 matmul ceiling"


def test_compare_says_why_a_ratio_is_missing():
    entries = [_entry("production", 16, 400.0),
               {"path": "peer_liger", "micro_batch": 16, "status": "skipped", "reason": "no CUDA device"}]
    rows = compare(entries, 16)
    assert rows[0]["value"] is None and rows[0]["met"] is None and "no CUDA device" in rows[0]["why_none"]
    realistic = next(r for r in rows if r["numerator_batches"] == "realistic")
    assert realistic["value"] is None and "production on realistic has no measurement" in realistic["why_none"]
    assert "no matmul ceiling" in rows[-1]["why_none"]


# --- the report -------------------------------------------------------------------------

@pytest.mark.slow
def test_perf_table_lists_every_path_ratio_and_kernel_path(smoke_record):
    table = perf_table(smoke_record)
    random_rows, realistic = table.split("Realistic lengths (")
    for entry in smoke_record["paths"]:
        part = random_rows if entry["batches"] == "random_rows" else realistic
        assert f"| {entry['path']} | {entry['micro_batch']} |" in part
    assert table.count("| tokens/s: production") == 2 and "| peak memory: production / best_peer |" in table
    # On a CPU the padded and the packed peer run on realistic lengths; the faster in this run is the best peer.
    fed = [e for e in entries_of(smoke_record, "realistic") if e["path"].startswith("peer") and e["status"] == "ok"]
    assert {e["path"] for e in fed} == {"peer_padded", "peer_packed"}
    fastest = max(fed, key=lambda e: e["supervised_tokens_per_s"])["path"]
    realistic_row = ("| supervised tokens/s: production (realistic) / best_peer (realistic) "
                     f"(production mb2 / {fastest} mb2)")
    assert realistic_row in table
    assert "| model TFLOP/s: production / bf16 matmul ceiling" in table and "product's targets" in table
    assert "| peer_liger | skipped: PathUnavailable: Liger's Triton kernels" in table
    assert "| peer_padding_free (realistic) | skipped: PathUnavailable: padding-free" in table
    assert "peer_padded: examples padded to the longest" in table
    assert "| reference (realistic) | as reference, but attention sdpa_mask |" in table
    assert "attention torch_sdpa" in table and "one checkpoint save" in table
    assert "issue" not in table.lower()


@pytest.mark.slow
def test_perf_table_shows_each_paths_median_clock_power_and_energy_per_token(smoke_record):
    """Under the board's power limit the clocks tell two paths' energy per step apart, and the energy per token
    (median watts over tokens/s; over supervised tokens/s on realistic lengths) is what their ratio divides; a
    CPU run has none."""
    record = json.loads(json.dumps(smoke_record))
    dense = next(e for e in record["paths"] if e["batches"] == "random_rows" and e["status"] == "ok")
    dense["gpu_clock_mhz"], dense["gpu_power_w"] = [1755, None, 1605, 1740], [690.2, 695.0, 640.0]
    dense["tokens_per_s"] = 345_100.0
    packed = next(e for e in record["paths"] if e["batches"] == "realistic" and e["status"] == "ok")
    packed["gpu_power_w"], packed["supervised_tokens_per_s"] = [600.0], 150_000.0
    lines = perf_table(record).splitlines()
    random_rows = lines[:next(i for i, line in enumerate(lines) if line.startswith("Realistic lengths"))]
    rows = [line for line in random_rows if line.startswith(f"| {dense['path']} | {dense['micro_batch']} |")]
    assert rows[0].endswith("| 1,740 | 690 | 2.00 |")  # 690.2 W / 345,100 tokens/s
    assert all(line.endswith("| - | - | - |") for line in rows[1:])
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("| path | micro-batch | supervised")):]
    realistic = next(line for line in table if line.startswith(f"| {packed['path']} | {packed['micro_batch']} |"))
    assert realistic.endswith("| 600 | 4.00 |")


@pytest.mark.slow
def test_perf_table_says_when_a_sides_best_is_the_largest_micro_batch_it_tried(smoke_record):
    """Each side at its best is only as good as the micro-batches tried: a best at the largest one that ran, with
    none larger out of memory, might not be the side's best."""
    record = json.loads(json.dumps(smoke_record))
    row = next(r for r in record["comparison"] if r["micro_batch"] == "best" and r["denominator"] == "best_peer")
    tried = [e["micro_batch"] for e in record["paths"]
             if e["path"] == "production" and e["batches"] == "random_rows"]
    row["numerator_entry"] = f"production mb{max(tried)}"
    note = f"production was fastest at micro-batch {max(tried)}, the largest this run measured for it"
    assert note in perf_table(record)
    assert "was fastest at micro-batch" not in headline_table(record)
    record["paths"].append({"path": "production", "batches": "random_rows", "micro_batch": 2 * max(tried),
                            "status": "oom", "reason": "CUDA out of memory", "peak_memory_gib": None})
    assert note not in perf_table(record)


def test_perf_table_reads_a_record_of_random_rows_only():
    """Records written before realistic lengths (no 'batches' field) still render."""
    record = json.loads((ROOT / "outputs" / "records" / "throughput_200m_h200.json").read_text())
    record["paths"] = [{k: v for k, v in e.items() if k != "batches"}
                       for e in record["paths"] if e.get("batches") == "random_rows"]
    record["comparison"] = [{k: v for k, v in c.items() if not k.endswith("_batches")}
                            for c in record["comparison"]
                            if {c.get("numerator_batches"), c.get("denominator_batches")} == {"random_rows"}]
    for key in ("batches", "realistic"):
        del record[key]
    table = perf_table(record)
    assert "| production | 16 |" in table and "| peer_liger | 16 |" in table
    assert "Realistic lengths" not in table and "(realistic)" not in table


@pytest.mark.slow
def test_a_generated_block_is_replaced_and_missing_markers_are_named(tmp_path, smoke_record, capsys):
    record_path = tmp_path / "record.json"
    record_path.write_text(json.dumps(smoke_record))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n<!-- perf-table {record_path} -->\nold\n<!-- /perf-table -->\n"
                    f"<!-- headline-table {record_path} -->\nold\n<!-- /headline-table -->\noutro\n")
    report_main(["perf-table", str(record_path), "--into", str(page)])
    report_main(["headline-table", str(record_path), "--into", str(page)])
    assert page.read_text() == (f"intro\n<!-- perf-table {record_path} -->\n{perf_table(smoke_record)}\n"
                                f"<!-- /perf-table -->\n<!-- headline-table {record_path} -->\n"
                                f"{headline_table(smoke_record)}\n<!-- /headline-table -->\noutro\n")
    assert "| ratio | micro-batch | measured | target | met |" in headline_table(smoke_record)
    report_main(["perf-table", str(record_path)])
    assert capsys.readouterr().out == perf_table(smoke_record) + "\n"
    with pytest.raises(ValueError, match="no line '<!-- perf-table outputs/records/x.json -->'"):
        update_block("no markers", "perf-table", "outputs/records/x.json", "table")


COMMITTED = sorted((ROOT / "outputs" / "records").glob("throughput_*.json"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.skipif(not COMMITTED, reason="no throughput record committed under outputs/records yet")
@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_every_committed_record_is_shown_and_its_blocks_are_current(path):
    name = str(path.relative_to(ROOT))
    record = json.loads(path.read_text())
    shown = 0
    for page in PAGES:
        text = page.read_text()
        for kind, table in TABLES.items():
            if f"<!-- {kind} {name} -->" in text:
                shown += 1
                assert update_block(text, kind, name, table(record)) == text, (
                    f"{page.name}'s {kind} for {name} is stale: python -m cflib.bench {kind} {name} "
                    f"--into {page.relative_to(ROOT)}")
    assert shown, f"{name} is committed but no page shows it (a perf-table or headline-table block)"
