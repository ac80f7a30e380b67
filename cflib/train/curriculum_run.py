"""A curriculum run: its stages in order in one run folder, each a run of its own (docs/curricula.md).

    out_dir/curriculum.json        the resolved stages and the audit, written before the first step
    out_dir/stages/<name>/         each stage's run folder: checkpoints, metrics.jsonl, record.json, COMPLETE
    out_dir/one_stage/             with compare_one_stage: the run's parameters alone, for the same total steps
    out_dir/record.json, COMPLETE  at the end: the last stage's record with `curriculum`, linking every stage

Each stage starts from the previous stage's best checkpoint with a fresh
optimizer and schedule. `resume: latest` continues where a killed run
stopped: finished stages are not re-run, the stage in progress resumes from
its newest resumable checkpoint exactly as one run does, and a stage killed
before its first such checkpoint starts again. `dry_run: true` writes only
the audit (out_dir/dry_run.json).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from cflib.atomic import check_writable_folder, write_json_atomic
from cflib.data.tasks import ensure_embedded_shard
from cflib.errors import ParamError
from cflib.jobs import job_out_dir, utc_now
from cflib.model.checkpoint import CheckpointError, latest_resumable
from cflib.model.config import ModelConfig
from cflib.paths import resolve_path
from cflib.train.curriculum import Curriculum, Stage, load_curriculum, one_stage, stage_params
from cflib.train.curriculum_audit import audit, stages_table
from cflib.train.launch import fit
from cflib.train.lock import RunLock
from cflib.train.params import TrainParams
from cflib.train.run import model_config, prepare

CURRICULUM_FILE, DRY_RUN_FILE = "curriculum.json", "dry_run.json"


@dataclass
class CurriculumRun:
    """A checked curriculum (or a dry run); nothing on disk has changed yet. `fit` trains it."""

    params: TrainParams
    curriculum: Curriculum
    out_dir: Path
    config: ModelConfig
    data_root: Path
    audit: list[dict]

    def describe(self) -> str:
        what = "dry run" if self.params.dry_run else "curriculum"
        source = self.curriculum.path or "the run's parameters"
        skipped = f"; after through_stage, not run: {', '.join(self.curriculum.skipped)}" \
            if self.curriculum.skipped else ""
        return (f"{what} {source}: {len(self.curriculum.stages)} stage(s) into {self.out_dir}{skipped}\n"
                + stages_table(self.audit))

    def fit(self, progress: bool = True) -> dict:
        """Train every stage (or write the dry run's audit) and return the record."""
        if self.params.dry_run:
            record = {"dry_run": True, "created_utc": utc_now(), "out_dir": str(self.out_dir),
                      "curriculum": str(self.curriculum.path) if self.curriculum.path else None,
                      "stages": self.audit}
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.out_dir / DRY_RUN_FILE, record)
            return record
        lock = RunLock(self.out_dir).acquire()
        try:
            return self._fit_stages(progress)
        finally:
            lock.release()

    def _fit_stages(self, progress: bool) -> dict:
        stages = {"curriculum": str(self.curriculum.path), "stages": [
            {"name": stage.name, "overrides": stage.overrides} for stage in self.curriculum.stages]}
        if not (self.out_dir / CURRICULUM_FILE).is_file():
            write_json_atomic(self.out_dir / CURRICULUM_FILE,
                              {**stages, "created_utc": utc_now(), "audit": self.audit})
        start_from, records = self.params.init_checkpoint, []
        for stage in self.curriculum.stages:
            record = self._fit_stage(stage, start_from, progress)
            records.append(record)
            start_from = selected_checkpoint(record) or start_from
        summary = curriculum_summary(self.curriculum, records, self.out_dir)
        if self.curriculum.compare_one_stage:
            summary["one_stage"] = self._fit_one_stage(sum(r["schedule"]["steps_done"] for r in records), progress)
        record = {**records[-1], "curriculum": summary}
        write_json_atomic(self.out_dir / "record.json", record)
        write_json_atomic(self.out_dir / "COMPLETE", {"completed_utc": utc_now(), "stages": len(records)})
        return record

    def _fit_one_stage(self, steps: int, progress: bool) -> dict:
        """The comparison: the run's parameters alone, for as many steps as the stages took together."""
        where = f"{self.curriculum.path}: compare_one_stage"
        stage = Stage("one_stage", stage_params(self.curriculum.run, {"max_steps": steps},
                                                self.out_dir / "one_stage", where), {"max_steps": steps})
        record = self._fit_stage(stage, self.params.init_checkpoint, progress)
        final = record["eval"]["final"]
        return {"out_dir": record["out_dir"], "steps": record["schedule"]["steps_done"],
                "final_eval": {"loss": final["loss"], "exact_match": final.get("exact_match", {}).get("overall")}}

    def _fit_stage(self, stage: Stage, start_from: str | None, progress: bool) -> dict:
        stage_dir = Path(stage.params.out_dir)
        if (stage_dir / "COMPLETE").is_file():  # finished before a kill: not re-run
            return json.loads((stage_dir / "record.json").read_text())
        resume = None
        if stage_dir.exists():
            try:
                latest_resumable(stage_dir / "checkpoints")
                resume = "latest"
            except CheckpointError:  # killed before its first resumable checkpoint: nothing to continue
                shutil.rmtree(stage_dir)
        params = replace(stage.params, init_checkpoint=start_from, resume=resume)
        params.validate()
        run = prepare(params)
        print(f"\n=== stage {stage.name}: {'resumed' if resume else 'from ' + (start_from or 'the preset')}\n"
              + run.describe())
        return fit(run, progress=progress)


def selected_checkpoint(record: dict) -> str | None:
    """The checkpoint the next stage starts from: the best, else the newest one saved."""
    checkpoints = {name: path for name, path in record.get("checkpoints", {}).items() if name != "best_step"}
    return checkpoints.get("best") or (list(checkpoints.values())[-1] if checkpoints else None)


def curriculum_summary(curriculum: Curriculum, records: list[dict], out_dir: Path) -> dict:
    """What links the stages: each one's folder, record, start, filters, weights and final held-out result."""
    stages, start_from = [], records[0]["params"]["init_checkpoint"]
    for stage, record in zip(curriculum.stages, records):
        final = record["eval"]["final"]
        weighting = record.get("loss_weighting")
        stages.append({
            "name": stage.name, "out_dir": record["out_dir"], "record": str(Path(record["out_dir"]) / "record.json"),
            "started_from": start_from, "selected_checkpoint": selected_checkpoint(record),
            "overrides": stage.overrides, "filters": record.get("filters"),
            "train_examples": record["data"]["train_examples"],
            "supervised_tokens": record["data"]["train_supervised_tokens"],
            "loss_coefficients": {cell["cell"]: cell["coefficient"] for cell in weighting["cells"]}
            if weighting else None,
            "steps": record["schedule"]["steps_done"], "early_stopping": record.get("early_stopping"),
            "final_eval": {"loss": final["loss"], "exact_match": final.get("exact_match", {}).get("overall")}})
        start_from = selected_checkpoint(record) or start_from
    return {"path": str(curriculum.path), "out_dir": str(out_dir), "through_stage": curriculum.stages[-1].name,
            "skipped": curriculum.skipped, "stages": stages}


def _root(params: TrainParams) -> Path:
    """The curriculum's run folder: a new one, or the one `resume: latest` continues."""
    if params.out_dir is None and params.resume is not None:
        raise ParamError("resume: latest needs the out_dir of the curriculum run to continue")
    # A curriculum's own folder is judged by _check_root: resumed, or refused when it holds one.
    out_dir = job_out_dir(params.out_dir, "runs", (), "a run", name="dry-run" if params.dry_run else "curriculum")
    if params.out_dir is not None:
        check_writable_folder(out_dir, "out_dir")
    return out_dir


def _check_root(params: TrainParams, out_dir: Path, curriculum: Curriculum) -> None:
    """A curriculum folder is continued (resume: latest, the same stages) or left alone."""
    started = (out_dir / CURRICULUM_FILE).is_file() or (out_dir / "stages").exists()
    if params.resume not in (None, "latest"):
        raise ParamError(f"resume: a curriculum resumes with resume: latest (its stages know their checkpoints), "
                         f"got {params.resume!r}")
    if (out_dir / "COMPLETE").is_file():
        raise ParamError(f"out_dir {out_dir} holds a completed run" + (": nothing to resume" if params.resume else
                                                                       "; choose another out_dir"))
    if started and params.resume is None:
        raise ParamError(f"out_dir {out_dir} already holds a curriculum run; choose another out_dir, or continue "
                         "it with resume: latest")
    if params.resume is not None and not started:
        raise ParamError(f"out_dir {out_dir} holds no curriculum run to resume")
    if (out_dir / CURRICULUM_FILE).is_file():
        written = json.loads((out_dir / CURRICULUM_FILE).read_text())["stages"]
        before = {stage["name"]: stage["overrides"] for stage in written}
        for stage in curriculum.stages:
            if stage.name in before and before[stage.name] != json.loads(json.dumps(stage.overrides)):
                raise ParamError(f"stage {stage.name!r} of {curriculum.path} differs from the stage this run "
                                 f"started with ({before[stage.name]}); resume with the same curriculum")


def prepare_curriculum(params: TrainParams) -> CurriculumRun:
    """Check a curriculum (or a dry run) against the data, every stage, without writing anything."""
    out_dir = _root(params)
    curriculum = load_curriculum(params, out_dir) if params.curriculum is not None else one_stage(params, out_dir)
    if not params.dry_run:
        _check_root(params, out_dir, curriculum)
    config, _ = model_config(replace(params, resume=None))  # every stage trains this architecture
    data_root = (ensure_embedded_shard(resolve_path("outputs/data")) if params.data == "embedded"
                 else resolve_path(params.data))
    rows = audit(curriculum, config, data_root, stop_at_first=not params.dry_run)
    return CurriculumRun(params, curriculum, out_dir, config, data_root, rows)
