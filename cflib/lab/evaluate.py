"""lm-evaluation-harness on a trained model, through its Hub bundle (notebooks/evaluate.ipynb).

The model is what transformers loads (`python -m cflib.export hub`, made here
when a run folder or checkpoint is named), scored by lm-eval's Python API
(`lm_eval.simple_evaluate` with an `HFLM` of the bundle), so the numbers are
the ones anyone gets with lm-eval. The bundle loads with cflib's own modeling
code (cflib.export.bundle): none of its Python files runs, and one whose
modules differ from cflib's is refused unless `trust_bundle_code`. The project ships two
small local tasks (examples/eval: multiple choice and exact match over the
embedded tasks); any task of lm-eval's registry (`piqa`, `arc_easy`, ...) runs
where its data can be downloaded. Every log-likelihood lm-eval reports for a
multiple-choice task is checked against cflib's own decoder on the same
tokens. Writes lm-eval's results JSON, its per-sample log, a record and a bar
chart; everything is checked before any model is scored.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

from cflib.atomic import atomic_file, save_figure, scratch_folder, write_json_atomic, write_text_atomic
from cflib.data.shards import sha256_file
from cflib.errors import ParamError
from cflib.export import ExportError, TokenizerExportError, export_hub
from cflib.export.bundle import check_bundle_code, register_own_classes
from cflib.export.peft import is_adapter_checkpoint
from cflib.jobs import job_out_dir, record_header, refuse_links
from cflib.jsonio import read_json
from cflib.lab.chat import train_here
from cflib.lab.report import _elsewhere as elsewhere
from cflib.lab.report import export_run
from cflib.model import CheckpointError, ConfigError, TRMoEModel, load_checkpoint
from cflib.model.checkpoint import holds_model
from cflib.paths import resolve_path
from cflib.progress import tqdm
from cflib.schema import Params, as_given, parsed_by
from cflib.train.run import resolve_device
from cflib.train.run_folder import read_run_record
from cflib.train.task_scores import CheckedTasks, check_tasks, quiet_lm_eval, score_rows

DEFAULT_TASKS = ("embedded_choice", "embedded_exact")
# The folders an evaluation writes in its out_dir: the bundle it exports, the model it trains, the tasks' configs.
EVAL_FOLDERS = ("bundle", "trained-here", "tasks")
TRAIN_HERE_STEPS = 32  # model None: a quickstart-size model this many steps into training (seconds on a CPU)
LOGLIKELIHOOD_CHECK_PAIRS = 64  # per task: the first (context, continuation) pairs recomputed by cflib
BUNDLE_FILES = ("config.json", "model.safetensors", "modeling_tr_hash_moe.py")


@dataclass(frozen=True)
class EvalParams(Params):
    """evaluate.ipynb's parameters. Defaults: a small model trained here, the shipped tasks, on the CPU."""

    model: str | None = None  # a run folder, a checkpoint or a Hub bundle; None: train a small model here
    tasks: str | list | tuple = parsed_by(as_given, DEFAULT_TASKS)  # names, or one string "piqa,arc_easy"
    limit: int | None = None  # examples per task; None: all
    batch_size: int = 8
    device: str = "auto"  # auto | cpu | cuda
    out_dir: str | None = None  # None: a new outputs/eval/<time>/
    # false: the bundle loads with cflib's own modeling code, and one whose Python files differ is refused; true:
    # its own modules run (transformers' trust_remote_code), only for a bundle whose author you trust
    trust_bundle_code: bool = False

    def task_names(self) -> list[str]:
        items = self.tasks.split(",") if isinstance(self.tasks, str) else list(self.tasks)
        return [str(item).strip() for item in items if str(item).strip()]

    def validate(self) -> None:
        if not isinstance(self.tasks, (str, list, tuple)) or not self.task_names():
            raise ParamError(f"tasks: one or more task names (a list, or 'piqa,arc_easy'), got {self.tasks!r}")
        if self.limit is not None and self.limit < 1:
            raise ParamError(f"limit must be None (every example) or a positive integer, got {self.limit}")
        if self.batch_size < 1:
            raise ParamError(f"batch_size must be a positive integer, got {self.batch_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ParamError(f"device must be auto, cpu or cuda, got {self.device!r}")


def is_bundle(folder: Path) -> bool:
    return all((folder / name).is_file() for name in BUNDLE_FILES)


def resolve_bundle(model: str | None, out_dir: Path, device: str) -> tuple[Path, str]:
    """(the bundle to score, how it was found): a bundle as it is; a run folder's bundle (out_dir/hub), else
    the one exported here from its best checkpoint with its data's tokenizer; a checkpoint exported here;
    None: a small model trained and exported here."""
    target = out_dir / "bundle"
    if model is None:
        checkpoint, _ = train_here(out_dir / "trained-here", TRAIN_HERE_STEPS, device)
        export_hub(checkpoint, target, tokenizer="byte", echo=None)
        return target, f"a quickstart-size model trained here for {TRAIN_HERE_STEPS} steps ({checkpoint})"
    path = resolve_path(model)
    if is_bundle(path):
        return path, f"the Hub bundle {path}"
    if (path / "record.json").is_file() and (path / "checkpoints").is_dir():
        if is_bundle(path / "hub"):
            return path / "hub", f"the run's Hub bundle {path / 'hub'}"
        exported = export_run(read_run_record(path), target)  # a copied run's paths lead into the copy
        if exported is None:
            raise ParamError(f"model {path}: the run's data names no tokenizer; export its bundle with "
                             f"python -m cflib.export hub {path} BUNDLE --tokenizer TOKENIZER and pass model=BUNDLE")
        return target, f"the Hub bundle of run {path}, exported here"
    if is_adapter_checkpoint(path):
        raise ParamError(f"model {path} holds LoRA adapters: merge them into their base first "
                         f"(python -m cflib.export merge {path} MERGED) and pass model=MERGED")
    if holds_model(path) or (path / "checkpoints").is_dir():  # a run folder without its record: its newest
        try:
            export_hub(path, target, echo=None)
        except TokenizerExportError as err:
            raise ParamError(f"model {path}: {err}; export its bundle with --tokenizer and pass the bundle") from None
        what = "checkpoint" if holds_model(path) else "the newest checkpoint of"
        return target, f"the Hub bundle of {what} {path}, exported here"
    raise ParamError(f"model {path}: neither a Hub bundle ({', '.join(BUNDLE_FILES)}), a run folder "
                     "(record.json, checkpoints/) nor a checkpoint (config.json, model.safetensors)")






@dataclass
class Evaluation:
    """A checked evaluation: the bundle, the tasks (lm-eval knows each one) and where the results go."""

    params: EvalParams
    bundle: Path
    model_source: str
    checked_tasks: CheckedTasks  # lm-eval's task manager and the shipped tasks' configs (out_dir/tasks by the run)
    device: torch.device
    out_dir: Path
    checked_model: TRMoEModel  # the bundle as cflib loads it, checked before lm-eval scores anything
    trust_remote_code: bool  # whether transformers runs the bundle's own modules (trust_bundle_code)

    @property
    def tasks(self) -> dict[str, dict]:
        """Task name -> how the record describes it, in the order named."""
        return self.checked_tasks.described


def prepare_evaluation(params: EvalParams) -> Evaluation:
    """Check the parameters, out_dir and every task name against the shipped tasks and lm-eval's registry (out_dir
    untouched, nothing written anywhere), then find (or export, or train) the bundle: a bad input stops here,
    before any model is scored."""
    out_dir = job_out_dir(params.out_dir, "eval", ("record.json",), "an evaluation")
    refuse_links(out_dir, EVAL_FOLDERS)  # its files are replaced whole (cflib.atomic), never written through
    device = resolve_device(params.device)
    tasks = check_tasks(params.task_names())
    try:
        bundle, source = resolve_bundle(params.model, out_dir, params.device)
        trust = check_bundle_code(bundle, params.trust_bundle_code, lambda why: ParamError(f"model {params.model}: "
                                                                                           f"{why}"))
        model = load_checkpoint(bundle, device).eval()  # cflib's checks of its config and weights come first
    except (ExportError, CheckpointError, ConfigError) as err:
        raise ParamError(f"model {params.model}: {err}") from None
    return Evaluation(params, bundle, source, tasks, device, out_dir, model, trust)




def loglikelihood_check(samples: dict[str, list[dict]], lm: Any, model: TRMoEModel, device: torch.device,
                        pairs_per_task: int = LOGLIKELIHOOD_CHECK_PAIRS) -> dict:
    """lm-eval's log-likelihood of each (context, continuation) against cflib's decoder (`model`) on the same
    tokens (lm-eval's own encoding of the pair), for the first pairs of every log-likelihood task."""
    worst, checked, tasks = 0.0, 0, []
    for task, rows in samples.items():
        pairs = [(argument, response[0][0]) for row in rows if all(isinstance(a, tuple) and len(a) == 2 and
                 isinstance(a[1], str) for a in row["arguments"])
                 for argument, response in zip(row["arguments"], row["resps"])][:pairs_per_task]
        if not pairs:
            continue
        tasks.append(task)
        for (context, continuation), reported in pairs:
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = torch.tensor([context_ids + continuation_ids], device=device)
            with torch.no_grad():
                logits = (model(ids[:, :-1]) @ model.head_weight.T).float().log_softmax(-1)[0]
            targets = ids[0, len(context_ids):]
            ours = float(logits[len(context_ids) - 1:].gather(1, targets[:, None]).sum())
            worst, checked = max(worst, abs(ours - float(reported))), checked + 1
    return {"tasks": tasks, "pairs": checked, "max_abs_diff": worst,
            "what": "sum of log p(continuation | context) from lm-eval's HFLM on the bundle vs cflib's TRMoEModel "
                    "on the same token ids, fp32"}


def plot_scores(rows: list[dict], save_to: Path | None = None) -> plt.Figure:
    """One bar per task and metric, with lm-eval's standard error."""
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(rows) + 2), 3.5))
    labels = [f"{row['task']}\n{row['metric']}" for row in rows]
    errors = [row["stderr"] or 0.0 for row in rows]
    bars = ax.bar(range(len(rows)), [row["value"] for row in rows], yerr=errors, capsize=4, color="#4c72b0")
    for bar, row, error in zip(bars, rows, errors):  # above the error bar
        ax.annotate(f"{row['value']:.3f}", (bar.get_x() + bar.get_width() / 2, bar.get_height() + error),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("score (lm-eval)")
    ax.set_ylim(0, max(1.0, max((row["value"] + (row["stderr"] or 0) for row in rows), default=1.0)) * 1.1)
    ax.set_title("lm-evaluation-harness, 0-shot")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    if save_to is not None:
        save_figure(fig, save_to)
    return fig




def run_evaluation(job: Evaluation, progress: bool = True) -> dict:
    """Score the bundle on every task through lm-eval (one task after another, a progress bar over them);
    write out_dir/lm_eval_results.json, samples_<task>.jsonl, record.json and scores.png."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import handle_non_serializable

    params, out_dir = job.params, job.out_dir
    dtype = "float32"  # log-likelihoods comparable with cflib's to float32 precision
    if not job.trust_remote_code:
        register_own_classes()  # the bundle loads with cflib's own modeling code; none of its files run
    lm = HFLM(pretrained=str(job.bundle), trust_remote_code=job.trust_remote_code, backend="causal",
              batch_size=params.batch_size, device=str(job.device), dtype=dtype)
    merged: dict[str, Any] = {}
    samples: dict[str, list[dict]] = {}
    start = time.perf_counter()
    with scratch_folder(out_dir / "cache") as cache:  # the shipped tasks' datasets cache, gone when scored
        for name in tqdm(list(job.tasks), desc="tasks", unit="task", disable=not progress):
            with quiet_lm_eval():
                result = lm_eval.simple_evaluate(model=lm, tasks=job.checked_tasks.specs([name], cache),
                                                 limit=params.limit, task_manager=job.checked_tasks.manager,
                                                 log_samples=True, num_fewshot=0)
            samples.update(result.pop("samples"))
            for key, value in result.items():
                if isinstance(value, dict) and isinstance(merged.get(key), dict):
                    merged[key].update(value)
                else:
                    merged[key] = value
    seconds = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    job.checked_tasks.write_configs(out_dir / "tasks")
    write_text_atomic(out_dir / "lm_eval_results.json", json.dumps(merged, indent=2, default=handle_non_serializable))
    for task, rows in samples.items():
        with atomic_file(out_dir / f"samples_{task}.jsonl") as staging, open(staging, "w") as out:
            out.writelines(json.dumps(row, default=handle_non_serializable) + "\n" for row in rows)
    rows = score_rows(merged)
    check = loglikelihood_check(samples, lm, job.checked_model, job.device)
    plt.close(plot_scores(rows, save_to=out_dir / "scores.png"))  # saved; the notebook shows its own
    record = {
        **record_header("evaluate", job.device, out_dir, packages=("lm_eval", "transformers")), "precision": dtype,
        "model": {"source": job.model_source, "bundle": str(job.bundle),
                  "sha256": sha256_file(job.bundle / "model.safetensors"),
                  "config": read_json(job.bundle / "config.json", ParamError, "model config (config.json)")},
        "tasks": job.tasks,
        "settings": {"limit": params.limit, "batch_size": params.batch_size, "num_fewshot": 0,
                     "lm_eval_model": "hf (HFLM, " + ("the bundle's own modules: trust_bundle_code)"
                                                      if job.trust_remote_code else "cflib's own modeling code)")},
        "scores": rows, "loglikelihood_check": check,
        "timing": {"seconds": seconds, "includes": "lm-eval's data loading, requests and metrics, every task"},
        "files": {"results": "lm_eval_results.json", "chart": "scores.png",
                  "samples": [f"samples_{task}.jsonl" for task in samples]},
    }
    write_json_atomic(out_dir / "record.json", record)
    return record


def evaluate(params: EvalParams, progress: bool = True) -> dict:
    return run_evaluation(prepare_evaluation(params), progress)


def scores_table(record: dict) -> str:
    """Markdown: task, metric, value ± stderr."""
    lines = ["| task | metric | value | stderr |", "| --- | --- | ---: | ---: |"]
    for row in record["scores"]:
        stderr = "-" if row["stderr"] is None or math.isnan(row["stderr"]) else f"{row['stderr']:.3f}"
        lines.append(f"| {row['task']} | {row['metric']} | {row['value']:.3f} | {stderr} |")
    return "\n".join(lines)


def show_scores(record: dict) -> None:
    from IPython.display import display

    table = scores_table(record)
    display({"text/markdown": table, "text/plain": table}, raw=True)


def headline(record: dict) -> str:
    """One deterministic line (what nbval compares for the default parameters)."""
    check = record["loglikelihood_check"]
    return (f"{len(record['tasks'])} tasks scored by lm-eval "
            f"({', '.join(record['tasks'])}); {check['pairs']} log-likelihoods checked against cflib, "
            f"agreeing to {'1e-4' if check['max_abs_diff'] < 1e-4 else 'more than 1e-4: investigate'}")


def evaluate_run(record: dict, tasks: str | None) -> dict | None:
    """train_sft's last step: the run's bundle (out_dir/hub, exported by the cell before) scored on `tasks`
    into out_dir/eval; None when tasks is None (off)."""
    if not tasks:
        print("eval_tasks: None, no lm-eval evaluation (name tasks, e.g. embedded_choice,embedded_exact)")
        return None
    if elsewhere(record):
        print(elsewhere(record))
        return None
    run_dir = Path(record["out_dir"])
    model = run_dir / "hub" if is_bundle(run_dir / "hub") else run_dir
    evaluation = evaluate(EvalParams(model=str(model), tasks=tasks, device=record["device"]["type"],
                                     out_dir=str(run_dir / "eval")))
    show_scores(evaluation)
    return evaluation
