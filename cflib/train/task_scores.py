"""lm-evaluation-harness tasks on a checkpoint: the shipped tasks and lm-eval's registry, scored through the
checkpoint's Hub bundle as anyone scores it (`lm_eval.simple_evaluate` with an `HFLM`), loaded with cflib's own
classes so that no file of the bundle runs.

`TaskScorer` is what a run with `eval_tasks_every` keeps (cflib.train.trainer): the task names are checked
when it is built, before step 1; each saved checkpoint it scores is exported to a bundle beside its results
(out_dir/eval_tasks/<checkpoint>/), scored, and the bundle removed again. cflib.lab.evaluate scores a finished
model with the same pieces.

The shipped tasks reach lm-eval as configs in memory (their data files resolved), never as files: checking and
scoring them writes nothing outside the run's or the evaluation's own folder, so a process killed at any point
leaves nothing behind in the system's temporary folder.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from cflib.atomic import write_text_atomic
from cflib.errors import ParamError, shown
from cflib.export import export_hub
from cflib.export.bundle import check_bundle_code
from cflib.export.peft import is_adapter_checkpoint, merge
from cflib.export.tokenizer_files import BYTE, TokenizerExportError, json_tokenizer_files
from cflib.jsonio import open_regular, read_bounded
from cflib.paths import resolve_path
from cflib.yamlio import MAX_BYTES, load_yaml

SHIPPED_TASKS = "examples/eval"  # the project's task YAMLs and their JSONL data


def _task_yaml(path: Path) -> tuple[dict, bytes]:
    """A shipped task's lm-eval config and the bytes it was parsed from (what its recorded SHA-256 is of): read
    once, bounded and from a regular file only, as every YAML cflib reads (cflib.yamlio), or a ParamError naming
    the file. A file anyone may drop into examples/eval/ is no less an input than a parameter file."""
    data = read_bounded(path, MAX_BYTES, ParamError, "task YAML")
    try:
        config = load_yaml(data.decode("utf-8"), str(path), ParamError)
    except UnicodeDecodeError as err:
        raise ParamError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise ParamError(f"{path}: an lm-eval task YAML is a mapping whose `task` names the task, got "
                         f"{shown(config)}")
    return config, data


def shipped_tasks() -> dict[str, Path]:
    """The project's tasks: name -> YAML."""
    found = {}
    for path in sorted(resolve_path(SHIPPED_TASKS).glob("*.yaml")):
        found[_task_yaml(path)[0]["task"]] = path
    return found


def shipped_configs(names: list[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """The named shipped tasks: (name -> its lm-eval config, its data files resolved to absolute paths, since
    lm-eval reads them relative to the working directory; name -> {yaml, sha256 of YAML and data})."""
    configs, described = {}, {}
    for name, path in shipped_tasks().items():
        if name not in names:
            continue
        config, data = _task_yaml(path)
        resolved = {split: (path.parent / file).resolve() for split, file in _data_files(config, path).items()}
        digests = {}
        for split, file in resolved.items():
            # Opened as every file cflib reads: a FIFO or a folder is named as what it is, not as missing, and the
            # digest is of the regular file that was checked.
            with open_regular(file, ParamError, f"{split} data file of task {name} ({path})") as handle:
                digests[split] = hashlib.file_digest(handle, "sha256").hexdigest()
        config["dataset_kwargs"]["data_files"] = {split: str(file) for split, file in resolved.items()}
        configs[name] = config
        described[name] = {"source": "shipped", "yaml": str(path), "yaml_sha256": hashlib.sha256(data).hexdigest(),
                           "data_sha256": digests}
    return configs, described


def _data_files(config: dict, path: Path) -> dict[str, str]:
    """A shipped task's dataset_kwargs.data_files: split -> JSONL file beside its YAML, or a ParamError naming the
    YAML and the key (lm-eval takes other forms, but a shipped task's files are resolved split by split here)."""
    kwargs = config.get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if files is None:
        raise ParamError(f"{path}: missing key dataset_kwargs.data_files; a shipped task maps each split to its "
                         "JSONL file beside the YAML there (data_files: {test: exact.jsonl})")
    if not isinstance(files, dict) or not files or not all(
            isinstance(split, str) and isinstance(file, str) and file for split, file in files.items()):
        raise ParamError(f"{path}: dataset_kwargs.data_files must map each split to its JSONL file beside the YAML "
                         f"(data_files: {{test: exact.jsonl}}), got {shown(files)}")
    return files


@dataclass(frozen=True)
class CheckedTasks:
    """Task names every one of which lm-eval can score: its TaskManager (holding its registry's index where a
    registry task is named), the shipped tasks' configs and each task described for the record (in the order
    named)."""

    manager: Any
    configs: dict[str, dict]  # the shipped tasks named, given to lm-eval as configs: no file is written for them
    described: dict[str, dict]

    def specs(self, names: list[str], cache_dir: Path) -> list[str | dict]:
        """simple_evaluate's `tasks` for names: a shipped task's config (a copy: lm-eval builds on what it is
        given) with `datasets`' cache of its data in `cache_dir` (the job's folder, not the user's home), a
        registry task's name (its Hub data in the Hugging Face cache, shared as every Hugging Face tool shares it)."""
        def shipped(name: str) -> dict:
            config = copy.deepcopy(self.configs[name])
            config["dataset_kwargs"] = {**config["dataset_kwargs"], "cache_dir": str(cache_dir)}
            return config
        return [shipped(name) if name in self.configs else name for name in names]

    def write_configs(self, folder: Path) -> None:
        """The shipped tasks' configs as they were scored, a YAML each, in folder (an evaluation's tasks/)."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, config in self.configs.items():
            write_text_atomic(folder / f"{name}.yaml", yaml.safe_dump(config, sort_keys=False))


def check_tasks(names: list[str], what: str = "tasks") -> CheckedTasks:
    """Every name a shipped task or one of lm-eval's registry: a ParamError naming one neither knows, or saying
    lm-eval is not installed. Writes nothing."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ParamError(f"{what}: lm-eval is not installed ({err}); pip install -e '.[eval]'") from None

    configs, described = shipped_configs(names)
    registry = [name for name in names if name not in configs]
    # lm-eval indexes its whole registry (some 15,000 YAML files: seconds) only when a name is not a shipped task;
    # the shipped ones reach it as configs, which need no index.
    manager = TaskManager(include_defaults=bool(registry))
    for name in registry:
        if name not in manager.all_tasks:
            raise ParamError(f"{what}: {name!r} is neither a task of this project ({', '.join(shipped_tasks())}) "
                             "nor one lm-eval knows (lm-eval --tasks list shows them)")
        described[name] = {"source": "lm-eval registry"}
    return CheckedTasks(manager, configs, {name: described[name] for name in names})


def score_rows(results: dict) -> list[dict]:
    """One row per task and metric: value and standard error, as lm-eval reports them."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filtering = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filtering}")
            rows.append({"task": task, "metric": metric, "filter": filtering, "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                         "samples": results.get("n-samples", {}).get(task, {}).get("effective")})
    return rows


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval's log at errors only: its notes (0-shot asked of a task with no default, --limit is for
    testing) would read as warnings in every notebook run; the record holds the settings instead."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class TaskScorer:
    """eval_tasks scored on a run's saved checkpoints; the tasks checked when it is built."""

    def __init__(self, names: tuple[str, ...], limit: int | None, tokenizer: str | None,
                 chat_template_sha256: str | None, device: str) -> None:
        if tokenizer is None:
            raise ParamError("eval_tasks_every: the data's index names no tokenizer to export the checkpoints' "
                             "bundles with; convert the data with --tokenizer, or remove eval_tasks_every")
        if tokenizer != BYTE:  # every checkpoint's bundle takes it: refused now, not after the first steps
            try:
                json_tokenizer_files(tokenizer, model_max_length=1)
            except TokenizerExportError as err:
                raise ParamError(f"eval_tasks_every: the data's tokenizer cannot go into the checkpoints' bundles: "
                                 f"{err}") from None
        self.names, self.limit, self.device = list(names), limit, device
        self.tokenizer, self.chat_template_sha256 = tokenizer, chat_template_sha256
        self.tasks = check_tasks(self.names, "eval_tasks")

    def score(self, checkpoint: Path, folder: Path) -> dict:
        """Every task on checkpoint's bundle; folder/lm_eval_results.json. {task: {metric: value}}, lm-eval's
        higher_is_better, the seconds it took (exporting the bundle included). The bundle (and a LoRA run's merged
        model) live in folder while it is scored, and go whatever happens; a killed run's are replaced when the
        checkpoint is scored again."""
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.utils import handle_non_serializable

        start = time.perf_counter()
        if folder.is_symlink() or folder.is_file():  # never followed: only the entry in the run folder goes
            folder.unlink()
        elif folder.exists():  # a resumed run scores the checkpoint again
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        try:
            model = checkpoint
            if is_adapter_checkpoint(checkpoint):  # a LoRA run: its adapters merged into their base first
                merge(checkpoint, folder / "merged")
                model = folder / "merged"
            bundle = export_hub(model, folder / "bundle", tokenizer=self.tokenizer, echo=None,
                                chat_template_sha256=self.chat_template_sha256)
            # Loaded with cflib's own classes: no file of the bundle runs (cflib.export.bundle).
            check_bundle_code(bundle, trust_bundle_code=False, error=ParamError)
            lm = HFLM(pretrained=str(bundle), trust_remote_code=False, batch_size=8, device=self.device,
                      dtype="float32")
            with quiet_lm_eval():
                results = lm_eval.simple_evaluate(model=lm, tasks=self.tasks.specs(self.names, folder / "cache"),
                                                  limit=self.limit, task_manager=self.tasks.manager, num_fewshot=0)
        finally:
            for scratch in ("bundle", "merged", "cache"):
                shutil.rmtree(folder / scratch, ignore_errors=True)
        write_text_atomic(folder / "lm_eval_results.json",
                          json.dumps(results, indent=2, default=handle_non_serializable))
        scores: dict[str, dict[str, float]] = {}
        for row in score_rows(results):
            scores.setdefault(row["task"], {})[row["metric"]] = row["value"]
        return {"lm_eval": scores, "lm_eval_higher_is_better": results.get("higher_is_better", {}),
                "lm_eval_seconds": time.perf_counter() - start}
