"""bench: measuring the project against itself, its peers and the device.

Owns steady-state throughput side by side with the peer stack (`throughput`,
`batches`, `peer`, `sessions`, `feeding`, `timing`, `synthetic`, `comparison`:
random rows and realistic SFT lengths, the peer fed as users feed it, the
product's targets), the micro-batch tuner (`tune`,
`search`, `memory`), kernel validation against float64 truth (`validate`,
`components`), decoding speed (`python -m cflib.bench.decode`), and the tables
and plots of their records (`python -m cflib.bench perf-table RECORD`): what a
notebook or a documented command reaches. The research probes that judged the
kernels' designs live beside the package, in benchmarks/, and import it; it
never imports them. Imports train, export, model, data, ops and the foundation
modules; never lab.
"""
from cflib.bench.plots import plot_error_heatmap, plot_microbatch_memory, plot_throughput
from cflib.bench.tables import perf_table, tuning_summary
from cflib.bench.throughput import ThroughputParams, measure
from cflib.bench.tune import TuneParams, prepare_tuning, tune
from cflib.bench.validate import check, error_table, run_job

__all__ = ["ThroughputParams", "TuneParams", "check", "error_table", "measure", "perf_table", "plot_error_heatmap",
           "plot_microbatch_memory", "plot_throughput", "prepare_tuning", "run_job", "tune", "tuning_summary"]
