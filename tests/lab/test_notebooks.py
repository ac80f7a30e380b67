"""The notebooks as papermill and JupyterLab see them: parameters, stripped outputs, real runs."""
from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import nbformat
import papermill
import pytest
import torch

from cflib.data.shards import sha256_file
from cflib.lab import nbclean
from cflib.lab.jupyter import KERNEL_NAME, LabError, lab_command
from cflib.train.params import TrainParams, load_params_file
from cflib.train.run import prepare

try:
    import sft_shard_helpers as h
    from tiny_models import trained_model
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests import sft_shard_helpers as h
    from tests.tiny_models import trained_model

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SFT = ROOT / "notebooks" / "train_sft.ipynb"
CHAT = ROOT / "notebooks" / "chat.ipynb"
EVALUATE = ROOT / "notebooks" / "evaluate.ipynb"


def parameters_cell(path: Path) -> dict[str, object]:
    notebook = nbformat.read(path, as_version=4)
    cells = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "exactly one cell tagged 'parameters'"
    tree = ast.parse(cells[0].source)
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)}


def test_parameters_cell_mirrors_train_params():
    assert parameters_cell(TRAIN_SFT) == {name: getattr(TrainParams(), name) for name in TrainParams.names()}


def test_init_checkpoint_is_described_with_its_hub_form_in_the_notebook_and_the_params():
    cell = next(c for c in nbformat.read(TRAIN_SFT, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    line = next(line for line in cell.source.splitlines() if line.startswith("init_checkpoint"))
    source = (ROOT / "cflib" / "train" / "params.py").read_text()
    described = source[source.index("class Model:"):source.index("init_checkpoint: str | None")]
    assert "hub:ORG/NAME[@REVISION]" in line and "hub:ORG/NAME[@REVISION]" in described


def test_evaluate_parameters_cell_mirrors_eval_params():
    from cflib.lab.evaluate import EvalParams

    defaults = {name: getattr(EvalParams(), name) for name in EvalParams.names()}
    assert parameters_cell(EVALUATE) == {**defaults, "tasks": list(defaults["tasks"])}


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_notebooks_carry_only_nbval_reference_outputs(path):
    """No outputs but nbval's references, kernel python3: `make strip` fixes a notebook saved in JupyterLab."""
    assert nbclean.problems(nbformat.read(path, as_version=4)) == []


def test_strip_undoes_what_a_jupyterlab_save_adds(tmp_path):
    notebook = nbformat.read(TRAIN_SFT, as_version=4)
    notebook.metadata.kernelspec = {"name": "cflib", "display_name": "cflib", "language": "python"}
    notebook.metadata.language_info = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
    notebook.metadata.widgets = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.execution_count = 3
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="trained\n")]
    saved = tmp_path / "train_sft.ipynb"
    nbformat.write(notebook, saved)
    assert nbclean.main(["--check", str(saved)]) == 1
    found = nbclean.problems(nbformat.read(saved, as_version=4))
    assert found[:2] == ["kernelspec 'cflib': the committed notebook names 'python3'",
                         "saved widget state in the notebook metadata"]
    assert any("train_form" in line for line in found)  # each dirty cell named
    assert nbclean.main([str(saved)]) == 0 and nbclean.main(["--check", str(saved)]) == 0
    cleaned = nbformat.read(saved, as_version=4)
    kept = [cell.outputs for cell in cleaned.cells if nbclean.NBVAL_MARK in cell.source]
    assert kept == [[nbformat.v4.new_output("stream", name="stdout", text="trained\n")]]  # nbval judges it
    assert cleaned.metadata.kernelspec.name == "python3" and "widgets" not in cleaned.metadata


def test_lab_offers_only_the_project_kernel():
    command = lab_command(ROOT, "notebooks", "--port=9999")
    assert f"--KernelSpecManager.allowed_kernelspecs={KERNEL_NAME}" in command
    assert "--LabApp.default_url=/lab/tree/notebooks" in command and command[-1] == "--port=9999"


def test_lab_without_the_registered_kernel_says_how_to_register_it(monkeypatch):
    monkeypatch.setattr("cflib.lab.jupyter.KERNEL_NAME", "cflib-never-registered")
    with pytest.raises(LabError, match="run `make setup`"):
        lab_command()


def test_release_profile_without_its_inputs_names_the_missing_checkpoint():
    params = TrainParams.from_dict({**load_params_file(ROOT / "params" / "sft_200m_release.yaml"), "device": "cpu"})
    with pytest.raises(ValueError, match="tr-hash-200m-refinement"):
        prepare(params)


@pytest.mark.slow
def test_papermill_runs_the_weighted_packed_smoke_profile_to_its_target_shares(tmp_path):
    """loss_groups, a nested mapping, reaches the notebook from the params YAML (-f)."""
    out_dir = tmp_path / "run"
    executed = tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(TRAIN_SFT), str(executed), parameters={
        **load_params_file(ROOT / "params" / "smoke_weighted.yaml"), "out_dir": str(out_dir),
        "exact_match_limit": 8}, cwd=str(ROOT / "notebooks"), progress_bar=False)
    text = "".join(o.get("text", "") for c in nbformat.read(executed, as_version=4).cells
                   if c.cell_type == "code" for o in c.outputs if o.output_type == "stream")
    assert "| arithmetic | addition x no-carry |" in text and "preflight train: 22,000 examples" in text
    widgets = [o for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code" for o in c.outputs
               if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert not widgets  # headless, no bar: the executed copy would keep one frozen at its first state
    assert "step 30/30" in text  # the trainer's text trace tells the progress instead
    record = json.loads((out_dir / "record.json").read_text())
    assert record["kernel_path"]["attention"] == "sdpa_mask"  # packed windows, each example attending to itself
    assert record["packing"]["examples"] == 22_000 and record["packing"]["examples_per_window"] > 3
    cells = record["loss_weighting"]["cells"]
    assert [c["cell"] for c in cells] == ["addition x carry", "addition x no-carry", "uppercase"]
    for cell in cells:
        assert cell["achieved_share"] == pytest.approx(cell["target_share"], abs=1e-12)
        # 30 steps of shuffled windows (a few percent of an epoch): close to the targets, not exact
        assert cell["trained_share"] == pytest.approx(cell["target_share"], abs=0.03), cell
    assert (out_dir / "loss_weighting.json").is_file() and (out_dir / "loss_weighting.png").is_file()


def stream_text(executed: Path) -> str:
    return "".join(o.get("text", "") for c in nbformat.read(executed, as_version=4).cells
                   if c.cell_type == "code" for o in c.outputs if o.output_type == "stream")


@pytest.mark.slow
def test_papermill_trains_a_curriculum_with_one_plot_and_a_row_per_stage(tmp_path):
    curriculum = tmp_path / "curriculum.yaml"
    curriculum.write_text("version: 1\nstages:\n  - {name: easy, filters: {difficulties: [easy]}, max_steps: 3}\n"
                          "  - {name: all, max_steps: 3, loss_task_targets: {addition: 0.6, uppercase: 0.4}}\n")
    out_dir, executed = tmp_path / "run", tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(TRAIN_SFT), str(executed), parameters={
        **load_params_file(ROOT / "params" / "smoke.yaml"), "out_dir": str(out_dir), "curriculum": str(curriculum),
        "exact_match_limit": 8}, cwd=str(ROOT / "notebooks"), progress_bar=False)
    text = stream_text(executed)
    assert "| easy | yes | 10,295 of 22,000 |" in text  # the audit, before training
    assert "=== stage all: from " in text and "| all | none | 22,000 | 126,000 | addition 1.08, uppercase 0.90 |" in text
    record = json.loads((out_dir / "record.json").read_text())
    assert [stage["name"] for stage in record["curriculum"]["stages"]] == ["easy", "all"]
    assert (out_dir / "loss_curves.png").is_file() and (out_dir / "stages" / "all" / "hub").is_dir()


@pytest.mark.slow
def test_papermill_dry_run_trains_nothing_and_writes_its_audit_alone(tmp_path):
    out_dir, executed = tmp_path / "run", tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(TRAIN_SFT), str(executed), parameters={
        "out_dir": str(out_dir), "curriculum": str(ROOT / "params" / "curricula" / "quickstart.yaml"),
        "model": "quickstart", "micro_batch_per_rank": 64, "global_batch": 64, "dry_run": True},
        cwd=str(ROOT / "notebooks"), progress_bar=False)
    assert "| medium | yes | 15,407 of 22,000 |" in stream_text(executed)
    assert "dry run: nothing was trained" in stream_text(executed)
    assert sorted(path.name for path in out_dir.iterdir()) == ["dry_run.json"]


@pytest.mark.slow
def test_papermill_dry_run_of_a_mixture_given_as_text_shows_each_source_s_share(tmp_path):
    """`-p data "[{path: A, weight: 0.8}, ...]"`: papermill passes the list as text, read as YAML."""
    from mixture_helpers import task_roots

    roots = task_roots(tmp_path / "roots", {"addition": 30, "uppercase": 12}, held_out=6)
    out_dir, executed = tmp_path / "run", tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(TRAIN_SFT), str(executed), parameters={
        "out_dir": str(out_dir), "dry_run": True, "examples_per_epoch": 40,
        "data": f"[{{path: {roots['addition']}, weight: 0.8}}, {{path: {roots['uppercase']}, weight: 0.2}}]"},
        cwd=str(ROOT / "notebooks"), progress_bar=False)
    shown = stream_text(executed)
    assert "| addition | 0.8 | 0.800 | 30 | 32 | 1.07 (repeated) | 0.800 |" in shown
    assert "| uppercase | 0.2 | 0.200 | 12 | 8 | 0.67 | 0.200 |" in shown
    assert sorted(path.name for path in out_dir.iterdir()) == ["dry_run.json"]


@pytest.mark.slow
def test_papermill_unknown_parameter_fails_before_anything_is_written(tmp_path):
    """train_sft's run; every other notebook reads its parameters the same way, before anything else (the test
    below), through Params.from_namespace, which refuses a name papermill injected that its class does not declare
    (tests/test_param_schema.py, and ChatParams in tests/lab/test_chat.py)."""
    out_dir = tmp_path / "run"
    refused = re.escape("notebook parameters: unknown parameter 'lrr' (did you mean 'lr'?)")
    with pytest.raises(papermill.PapermillExecutionError, match=refused):
        papermill.execute_notebook(str(TRAIN_SFT), str(tmp_path / "executed.ipynb"),
                                   parameters={"lrr": 0.1, "out_dir": str(out_dir)},
                                   cwd=str(ROOT / "notebooks"), progress_bar=False)
    assert not out_dir.exists()


@pytest.mark.slow
def test_papermill_launches_torchrun_from_the_notebook(tmp_path):
    out_dir = tmp_path / "run"
    executed = tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(TRAIN_SFT), str(executed), parameters={
        **load_params_file(ROOT / "params" / "smoke.yaml"), "out_dir": str(out_dir), "max_steps": 4,
        "nproc_per_node": 2, "micro_batch_per_rank": 8}, cwd=str(ROOT / "notebooks"), progress_bar=False)
    text = "".join(o.get("text", "") for c in nbformat.read(executed, as_version=4).cells
                   if c.cell_type == "code" for o in c.outputs if o.output_type == "stream")
    assert "[rank 0] step 4/4" in text and "[rank 1] step 4/4" in text  # every rank, streamed live
    record = json.loads((out_dir / "record.json").read_text())
    assert record["world_size"] == 2 and record["strategy"] == "ddp" and record["grad_accum"] == 2


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_nbval_sees_every_check_output_marker(path):
    """nbval honours a marker only alone on its comment line; a cell it ignores would check nothing."""
    from nbval.plugin import find_comment_markers
    for cell in nbformat.read(path, as_version=4).cells:
        if "NBVAL_CHECK_OUTPUT" in cell.source:
            assert ("check", True) in list(find_comment_markers(cell.source)), cell.source[:60]
            assert cell.outputs, "a checked cell needs its expected output committed"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from cflib.model import save_checkpoint

    path = tmp_path_factory.mktemp("chat-model") / "best"
    save_checkpoint(trained_model([e.input_ids for e in h.chat_examples()], h.VOCAB, steps=25), path)
    return path


@pytest.mark.slow
def test_papermill_chat_answers_every_prompt_of_a_jsonl_file(tmp_path, tiny_checkpoint):
    prompts = tmp_path / "prompts.jsonl"
    conversations = [[{"role": "user", "content": "12+34="}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "reverse dog"}]]
    prompts.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    out_dir = tmp_path / "chat"
    papermill.execute_notebook(str(CHAT), str(tmp_path / "executed.ipynb"), parameters={
        "checkpoint": str(tiny_checkpoint), "prompts": str(prompts), "max_new_tokens": 6, "out_dir": str(out_dir),
        "device": "cpu"}, cwd=str(ROOT / "notebooks"), progress_bar=False)
    rows = [json.loads(line) for line in (out_dir / "answers.jsonl").read_text().splitlines()]
    assert [row["messages"] for row in rows] == conversations and all(len(row["answer_ids"]) <= 6 for row in rows)
    record = json.loads((out_dir / "record.json").read_text())
    assert record["checkpoint"]["sha256"] == sha256_file(tiny_checkpoint / "model.safetensors")
    assert record["timing"]["tokens_per_s"] > 0 and record["prompts"]["source"] == str(prompts)
    assert not (out_dir / "trained-here").exists()  # a checkpoint was named: nothing trained


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for a machine without a GPU")
def test_papermill_validates_the_kernels_on_a_cpu_without_triton_interpret_set(tmp_path, monkeypatch):
    """Headless on a CPU, as the README promises every notebook's defaults run: the notebook switches Triton's
    interpreter on itself, before any kernel is defined; a misspelt parameter stops it before anything runs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel papermill starts inherits this environment
    notebook, out_dir = ROOT / "notebooks" / "validate_kernels.ipynb", tmp_path / "validate"
    papermill.execute_notebook(str(notebook), str(tmp_path / "executed.ipynb"), parameters={
        "out_dir": str(out_dir), "dtypes": "float32"}, cwd=str(ROOT / "notebooks"), progress_bar=False)
    record = json.loads((out_dir / "record.json").read_text())
    assert record["triton_interpreter"] and {row["dtype"] for row in record["rows"]} == {"float32"}
    ran = {row["component"] for row in record["rows"]}
    assert {"trmoe", "add_rmsnorm", "qk_norm_rope"} <= ran and all(row["passed"] for row in record["rows"])
    with pytest.raises(papermill.PapermillExecutionError, match="dtype"):
        papermill.execute_notebook(str(notebook), str(tmp_path / "typo.ipynb"), parameters={
            "out_dir": str(tmp_path / "typo"), "dtype": "float32"}, cwd=str(ROOT / "notebooks"), progress_bar=False)
    assert not (tmp_path / "typo").exists()


@pytest.mark.slow
def test_papermill_runs_the_smoke_profile_and_ends_with_an_lm_eval_evaluation_of_its_bundle(tmp_path):
    out_dir, executed = tmp_path / "run", tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(TRAIN_SFT), str(executed), parameters={
        **load_params_file(ROOT / "params" / "smoke.yaml"), "out_dir": str(out_dir), "max_steps": 2,
        "eval_tasks": "embedded_choice"}, cwd=str(ROOT / "notebooks"), progress_bar=False)
    notebook = nbformat.read(executed, as_version=4)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = stream_text(executed)
    assert "step 2/2" in text  # the text trace papermill keeps
    assert "greedy, 5 held-out prompts" in text and text.count("expected ") == 5  # the best checkpoint's answers
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the loss plot
    form_cell = next(c for c in notebook.cells if "train_form(globals())" in c.source)
    assert form_cell.outputs == []  # no form under papermill
    run = json.loads((out_dir / "record.json").read_text())
    assert run["grad_accum"] == 2 and run["schedule"]["steps_done"] == 2
    assert (out_dir / "loss_curves.png").is_file()
    record = json.loads((out_dir / "eval" / "record.json").read_text())
    assert record["model"]["bundle"] == str(out_dir / "hub") and list(record["tasks"]) == ["embedded_choice"]
    assert record["model"]["sha256"] == sha256_file(out_dir / "hub" / "model.safetensors")
    assert record["loglikelihood_check"]["max_abs_diff"] < 1e-4


NOTEBOOK_PARAMETERS = {"train_sft.ipynb": "cflib.train.params:TrainParams", "chat.ipynb": "cflib.lab.chat:ChatParams",
                       "evaluate.ipynb": "cflib.lab.evaluate:EvalParams", "sweep.ipynb": "cflib.lab.sweep:SweepParams",
                       "compare_runs.ipynb": "cflib.lab.compare:CompareParams",
                       "convert_chat.ipynb": "cflib.data.convert:ConvertParams",
                       "tune_microbatch.ipynb": "cflib.bench.tune:TuneParams",
                       "measure_throughput.ipynb": "cflib.bench.throughput:ThroughputParams",
                       "validate_kernels.ipynb": "cflib.bench.validate:ValidateParams"}


def parameter_class(notebook: str) -> type:
    module, name = NOTEBOOK_PARAMETERS[notebook].split(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("notebook", sorted(NOTEBOOK_PARAMETERS))
def test_no_later_cell_binds_a_parameter_name(notebook):
    """Re-running the checks after the whole notebook reads every declared name from the namespace: a later
    cell that bound one would hand the re-run its value instead of the parameter's."""
    declared = set(parameter_class(notebook).names())
    bound = {}
    for index, cell in enumerate(nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells):
        if cell.cell_type != "code" or "parameters" in cell.metadata.get("tags", []):
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in declared:
                bound[node.id] = f"cell {index}"
    assert not bound, bound


@pytest.mark.parametrize("notebook", sorted(NOTEBOOK_PARAMETERS))
def test_each_notebook_reads_its_parameters_through_its_class_before_anything_else(notebook):
    """The first cell after the parameters (and the form JupyterLab shows) that does anything starts by reading
    them through the notebook's parameter class: a misspelt papermill parameter stops there, nothing written."""
    name = parameter_class(notebook).__name__
    code = [c for c in nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells if c.cell_type == "code"]
    start = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", [])) + 1
    working = next(c for c in code[start:] if not re.fullmatch(r"\w+_form\(globals\(\)\)", c.source.splitlines()[-1]))
    first = next(node for node in ast.parse(working.source).body if not isinstance(node, (ast.Import, ast.ImportFrom)))
    reads = rf"\w+ = (\w+\()?{name}\.from_namespace\(globals\(\)\)(?(1)\))"
    assert re.fullmatch(reads, ast.unparse(first)), ast.unparse(first)


def rerun_notebook(tmp_path: Path) -> Path:
    """train_sft's parameters cell, a later cell binding scalars, then its checks' first line run again."""
    notebook = nbformat.read(TRAIN_SFT, as_version=4)
    parameters = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    notebook.cells = [parameters, nbformat.v4.new_code_cell('bundle = "hub"\nsteps_seen = 3\nnote = None'),
                      nbformat.v4.new_code_cell("from cflib.train import TrainParams\n\n"
                                                "print('lr', TrainParams.from_namespace(globals()).lr)")]
    path = tmp_path / "rerun.ipynb"
    nbformat.write(notebook, path)
    return path


@pytest.mark.slow
def test_papermill_parameters_are_the_declared_names_whatever_later_cells_bound(tmp_path):
    source, executed = rerun_notebook(tmp_path), tmp_path / "executed.ipynb"
    papermill.execute_notebook(str(source), str(executed), parameters={"lr": 0.002}, progress_bar=False)
    text = "".join(o.get("text", "") for c in nbformat.read(executed, as_version=4).cells
                   if c.cell_type == "code" for o in c.outputs if o.output_type == "stream")
    assert "lr 0.002" in text
