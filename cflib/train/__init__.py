"""train: one SFT job from checked parameters to a finished run folder.

Owns the parameters (`params`), `prepare` (every check, nothing written),
the execution plan resolved before step 1 (`execution`), one optimizer step
(`step`) and the loop around it (`trainer`), the optimizer and schedule
(`optim`), curricula
(`curriculum`, `curriculum_audit`, `curriculum_run`; `start` picks one run or
a curriculum), data
parallelism (`distributed`, `launch`; `python -m cflib.train PARAMS.json`
is a torchrun worker), held-out evaluation, run records and the cluster
arithmetic (`python -m cflib.train.sizing`). Imports model, data, ops, export
and the foundation modules; never bench or lab.
"""
from cflib.errors import ParamError
from cflib.train.start import prepare_job, train
from cflib.train.launch import fit
from cflib.train.params import TrainParams
from cflib.train.run import Run, batch_arithmetic, describe_arithmetic, prepare
from cflib.train.trainer import Trainer

__all__ = ["ParamError", "Run", "TrainParams", "Trainer", "batch_arithmetic", "describe_arithmetic", "fit",
           "prepare", "prepare_job", "train"]
