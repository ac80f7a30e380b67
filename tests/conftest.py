"""Without a GPU, every Triton kernel (Liger's and cflib's) runs in Triton's interpreter.

Set before anything imports Triton: the interpreter is chosen when a kernel is defined.
Notebooks started by these tests inherit it through the environment.

Under pytest-xdist (`make test` runs a worker per core and one more) the cores
are shared out: each worker's OpenMP threads would otherwise spin on cores
another worker needs, and the suite ran no faster with two workers than with
one. The kernels, notebooks and torchrun jobs a test starts inherit the share.

Once every test module is imported, what exists is frozen out of the garbage collector's walks: a process that
imported every test module's libraries tracks some 760,000 objects, and a full collection walks them all (0.46 s of
CPU on an idle core). The trainer makes one before every run, the throughput measurement one before every path:
some 250 in a `make test`, 210 s spent in them across its workers. The trainer leaves a freeze it finds in place
(cflib.train.collector); the tests of its own freeze lift this one while they run (`collector_unfrozen`).
"""
import gc
import os

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

import torch  # noqa: E402  (after OMP_NUM_THREADS, which OpenMP reads once)

if _workers > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


def _freeze_what_exists() -> None:
    gc.collect()  # garbage is collected, not frozen
    gc.freeze()


def pytest_collection_modifyitems(config, items) -> None:
    """The files that start processes first, those with the most such tests before the others, the quick files
    last: `make test` hands whole files to its workers in this order (--dist loadfile), so that the last files to
    finish are short ones rather than a file of torchrun or papermill runs started near the end. Within a file
    the order stays as written, and every worker sorts the same collection alike."""
    slow: dict = {}
    for item in items:
        heavy = item.get_closest_marker("slow") is not None or item.path.suffix == ".ipynb"  # nbval's cells run
        slow[item.path] = slow.get(item.path, 0) + heavy
    first_seen = {path: index for index, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


def pytest_collection_finish(session) -> None:
    _freeze_what_exists()


def pytest_sessionfinish(session) -> None:
    gc.unfreeze()  # the process ends as it would have without the freeze


@pytest.fixture
def collector_unfrozen():
    """No object frozen while the test runs, as in a process that never froze any; the freeze back after it."""
    gc.unfreeze()
    yield
    _freeze_what_exists()
