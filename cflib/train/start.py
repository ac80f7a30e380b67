"""One call from parameters to a trained run folder: a single run, a curriculum, or a dry run."""
from __future__ import annotations

from cflib.train.curriculum_run import CurriculumRun, prepare_curriculum
from cflib.train.launch import fit
from cflib.train.params import TrainParams
from cflib.train.run import Run, prepare


def prepare_job(params: TrainParams) -> Run | CurriculumRun:
    """prepare() for one run; with a curriculum or dry_run, every stage checked against the data."""
    if params.curriculum is not None or params.dry_run:
        return prepare_curriculum(params)
    return prepare(params)


def train(params: TrainParams | dict, progress: bool = True) -> dict:
    """Check everything, then train (here or through torchrun); returns the record of out_dir/record.json."""
    if isinstance(params, dict):
        params = TrainParams.from_dict(params)
    job = prepare_job(params)
    print(job.describe())
    return fit(job, progress=progress)
