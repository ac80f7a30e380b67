"""Without a GPU, every Triton kernel (Liger's and cflib's) runs in Triton's interpreter.

Set before anything imports Triton: the interpreter is chosen when a kernel is defined.
Notebooks started by these tests inherit it through the environment.

Under pytest-xdist (`make test` runs a worker per core and one more) the cores
are shared out: each worker's OpenMP threads would otherwise spin on cores
another worker needs, and the suite ran no faster with two workers than with
one. The kernels, notebooks and torchrun jobs a test starts inherit the share.
"""
import os

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

import torch  # noqa: E402  (after OMP_NUM_THREADS, which OpenMP reads once)

if _workers > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
