"""Triton kernels, apart from the modules that use them (cflib.kernels dispatches).

Each op has a PyTorch reference in cflib.model / cflib.loss and a test comparing
forward and backward against it (tests/test_ops.py). Importing this package
under TRITON_INTERPRET=1 makes Liger's kernels runnable by Triton's interpreter.
"""
from . import interpreter  # noqa: F401  (side effect only under TRITON_INTERPRET=1)
