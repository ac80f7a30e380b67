"""A curriculum run: its stages in order in one run folder, each a run of its own (docs/curricula.md).

    out_dir/curriculum.json        the resolved stages, each with its settings, and the audit, written before step 1
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
from dataclasses import dataclass, replace
from pathlib import Path

from cflib.atomic import check_writable_folder, set_aside, write_json_atomic
from cflib.errors import ParamError
from cflib.export.pull import HubStart, is_hub, pinned_spec
from cflib.jobs import job_out_dir, utc_now
from cflib.jsonio import read_json
from cflib.model.checkpoint import CheckpointError, latest_resumable
from cflib.model.config import ModelConfig
from cflib.train.curriculum import Curriculum, Stage, load_curriculum, one_stage, stage_params
from cflib.train.curriculum_audit import audit, stages_table
from cflib.train.launch import fit
from cflib.train.lock import RunLock
from cflib.train.params import TrainParams
from cflib.train.registered import for_workers
from cflib.train.resume_identity import ALLOWABLE, STREAM
from cflib.train.run import pinned_hub_start, prepare, start_config
from cflib.train.run_folder import check_entries_inside, read_run_record, refuse_mixing
from cflib.train.teacher import INIT, init_teacher

CURRICULUM_FILE, DRY_RUN_FILE = "curriculum.json", "dry_run.json"
# What shaped a stage's training, whether the stage or the run set it: a stage that trained keeps them on resume, as
# one run does (cflib.train.resume_identity). Where the data and the model live may move with a copied folder: the
# stage in progress checks them by their hashes. exact_match_limit shapes no training, only what an answer-scoring
# best_metric compares: the stage in progress checks the prompts it chooses, a finished stage's best/ is chosen.
STAGE_SETTINGS = tuple(name for name in (*STREAM, *ALLOWABLE, "epochs", "max_steps", "warmup_ratio")
                       if name in TrainParams.names() and name not in ("data", "model", "exact_match_limit"))


def stage_settings(params: TrainParams) -> dict:
    """A stage's settings as curriculum.json records them (plain JSON)."""
    return json.loads(json.dumps({name: getattr(params, name) for name in STAGE_SETTINGS}))


@dataclass
class CurriculumRun:
    """A checked curriculum (or a dry run); nothing on disk has changed yet. `fit` trains it."""

    params: TrainParams
    curriculum: Curriculum
    out_dir: Path
    config: ModelConfig  # the model the first stage starts from (the stages may extend its positions)
    audit: list[dict]
    hub_start: dict | None = None  # init_checkpoint hub:ORG/NAME: the commit every stage starts from, pinned once

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
            written = _check_root(self.params, self.out_dir, self.curriculum)  # again, under the lock: no second writer
            return self._fit_stages(progress, written)
        finally:
            lock.release()

    def _fit_stages(self, progress: bool, written: dict | None) -> dict:
        """The stages trained in turn; `written`: curriculum.json as _check_root read it under the lock (None: none)."""
        # A finished stage keeps the settings it trained with, whatever a resume allowed to change since.
        finished = {stage["name"]: stage.get("settings") for stage in (written or {}).get("stages", [])
                    if (self.out_dir / "stages" / str(stage["name"]) / "COMPLETE").is_file()}
        stages = {"curriculum": str(self.curriculum.path), "stages": json.loads(json.dumps([
            {"name": stage.name, "overrides": stage.overrides,
             "settings": finished.get(stage.name) or stage_settings(stage.params)}
            for stage in self.curriculum.stages]))}
        if written is None or written.get("stages") != stages["stages"]:
            # New, or resumed with stages not started yet changed (or added by a later through_stage), or with a
            # change allowed on purpose: the file says what this run trains, and since when.
            changed = {} if written is None else {"created_utc": written.get("created_utc"), "changed_utc": utc_now()}
            write_json_atomic(self.out_dir / CURRICULUM_FILE,
                              {**stages, "created_utc": utc_now(), **changed, "audit": self.audit,
                               "hub_start": self.hub_start})
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
        if not self.curriculum.skipped:  # through_stage left stages for a later resume: not complete yet
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
            return read_run_record(stage_dir, "stage")
        resume = None
        if stage_dir.exists():
            try:
                latest_resumable(stage_dir / "checkpoints")
                resume = "latest"
            except CheckpointError:  # killed before its first resumable checkpoint: it starts again, kept aside
                print(f"stage {stage.name}: killed before its first resumable checkpoint; it starts again, what "
                      f"it left kept in {set_aside(stage_dir)}")
        # teacher_checkpoint: init distils from the curriculum's start in every stage, not from the stage before's
        teacher = init_teacher(self.params.init_checkpoint) if stage.params.teacher_checkpoint == INIT else \
            stage.params.teacher_checkpoint
        params = replace(stage.params, init_checkpoint=start_from, resume=resume, teacher_checkpoint=teacher)
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
    """What links the stages: each one's folder, record, start, filters (and the examples overlong_examples: drop
    left out), weights and final held-out result."""
    stages, start_from = [], records[0]["params"]["init_checkpoint"]
    for stage, record in zip(curriculum.stages, records):
        final = record["eval"]["final"]
        weighting = record.get("loss_weighting")
        stages.append({
            "name": stage.name, "out_dir": record["out_dir"], "record": str(Path(record["out_dir"]) / "record.json"),
            "started_from": start_from, "selected_checkpoint": selected_checkpoint(record),
            "overrides": stage.overrides, "filters": record.get("filters"),
            "overlong": record["data"].get("overlong"), "train_examples": record["data"]["train_examples"],
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


def _check_root(params: TrainParams, out_dir: Path, curriculum: Curriculum) -> dict | None:
    """A curriculum folder is continued (resume: latest, the same stages) or left alone; its curriculum.json as
    read (None: none yet)."""
    check_entries_inside(out_dir)
    refuse_mixing(out_dir, "curriculum")
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
    if not (out_dir / CURRICULUM_FILE).is_file():
        return None
    written = read_json(out_dir / CURRICULUM_FILE, ParamError, "curriculum file")
    if not isinstance(written, dict) or not isinstance(written.get("stages"), list) or not all(
            isinstance(stage, dict) and "name" in stage and "overrides" in stage for stage in written["stages"]):
        raise ParamError(f"{out_dir / CURRICULUM_FILE}: not a curriculum's file (stages, each with name and "
                         "overrides)")
    before = {stage["name"]: stage for stage in written["stages"]}
    for stage in curriculum.stages:  # one that starts (again) from scratch may be corrected
        if _kept(out_dir / "stages" / stage.name):
            _check_kept_stage(stage, before.get(stage.name), params, curriculum.path)
    return written


def _kept(stage_dir: Path) -> bool:
    """Whether a resume keeps what a stage trained: it finished, or continues from a resumable checkpoint (one
    killed before its first starts again, its folder set aside, as one never started)."""
    if (stage_dir / "COMPLETE").is_file():
        return True
    try:
        latest_resumable(stage_dir / "checkpoints")
    except CheckpointError:
        return False
    return True


def _check_kept_stage(stage: Stage, written: dict | None, params: TrainParams, path: Path | None) -> None:
    """ParamError when this run would give a stage whose training it keeps other overrides, or (through the run's
    own parameters) other settings than allow_resume_changes allows."""
    overrides = (written or {}).get("overrides")
    if overrides != json.loads(json.dumps(stage.overrides)):
        raise ParamError(f"stage {stage.name!r} of {path} differs from the stage this run trained ({overrides}); "
                         "resume with the same stages up to the ones not started yet, which may change")
    then = written.get("settings")
    if not isinstance(then, dict):  # written before stages recorded their settings
        return
    now, allowed = stage_settings(stage.params), set(params.allow_resume_changes or ())
    for name in STAGE_SETTINGS:
        if name in then and then[name] != now[name] and (name not in ALLOWABLE or name not in allowed):
            hint = (f"resume with the value it trained with, or set allow_resume_changes: {name} to change it on "
                    "purpose") if name in ALLOWABLE else ("a stage that trained keeps its stream and schedule; resume "
                                                          "with the value it trained with")
            raise ParamError(f"stage {stage.name!r} trained with {name} {then[name]}, this run gives it {now[name]} "
                             f"(the stage's own parameter, or the run's it takes): {hint}")


def prepare_curriculum(params: TrainParams) -> CurriculumRun:
    """Check a curriculum (or a dry run) against the data, every stage, without writing anything."""
    out_dir = _root(params)
    params, hub = _pinned_start(params, out_dir)
    curriculum = load_curriculum(params, out_dir) if params.curriculum is not None else one_stage(params, out_dir)
    if params.world_size > 1:  # a loss or metric a later stage's workers could not import: refused now, not then
        compared = [curriculum.run] if curriculum.compare_one_stage else []
        for stage_run in [stage.params for stage in curriculum.stages] + compared:
            for_workers(stage_run)
    if not params.dry_run:
        _check_root(params, out_dir, curriculum)
    config, _ = start_config(replace(params, resume=None))  # every stage trains this architecture, from here
    rows = audit(curriculum, config, stop_at_first=not params.dry_run)  # each stage against its own data
    return CurriculumRun(params, curriculum, out_dir, config, rows, None if hub is None else hub.record())


def _pinned_start(params: TrainParams, out_dir: Path) -> tuple[TrainParams, HubStart | None]:
    """`params` with a Hub init_checkpoint pinned once, so that every stage and compare_one_stage start from one
    commit: a resume's is the commit curriculum.json records (the revision the run named stands for it, as a
    resumed run's does). A resume of a curriculum.json written before it recorded one pins nothing here: each
    stage resolves its start as it did."""
    if not is_hub(params.init_checkpoint):
        return params, None
    recorded = None
    if params.resume is not None:
        written = read_json(out_dir / CURRICULUM_FILE, ParamError, "curriculum file") if (
            out_dir / CURRICULUM_FILE).is_file() else None
        recorded = written.get("hub_start") if isinstance(written, dict) else None
        if not (isinstance(recorded, dict) and isinstance(recorded.get("repo_id"), str)
                and isinstance(recorded.get("commit"), str)):
            return params, None
    spec = None if recorded is None else pinned_spec(recorded)
    return pinned_hub_start(params, spec, recorded)
