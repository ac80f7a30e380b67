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
modules; never lab. Its names load on first use (cflib.lazy): `python -m
cflib.bench perf-table` starts without torch.
"""
from __future__ import annotations

from cflib.lazy import lazy_names

_MODULE_OF = {
    **dict.fromkeys(["plot_error_heatmap", "plot_microbatch_memory", "plot_throughput"], "cflib.bench.plots"),
    **dict.fromkeys(["perf_table", "tuning_summary"], "cflib.bench.tables"),
    **dict.fromkeys(["ThroughputParams", "measure"], "cflib.bench.throughput"),
    # Not `tune`: once its module is imported, the package's attribute of that name is the module.
    **dict.fromkeys(["TuneParams", "prepare_tuning"], "cflib.bench.tune"),
    **dict.fromkeys(["check", "error_table", "run_job", "ValidateParams"], "cflib.bench.validate"),
}
__all__ = sorted(_MODULE_OF)
__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF)
