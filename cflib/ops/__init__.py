"""ops: the kernels and what chooses them.

Owns the Triton kernels (cflib's own and Liger's through `liger`), the PyTorch
reference each one is tested against (`loss` for the chunked cross-entropy;
the model's modules for the rest), the attention backends, and `dispatch`,
which decides which kernels may run on this machine (the `KernelChoice`). Imports nothing else of cflib but
`cflib.errors`. Importing it under TRITON_INTERPRET=1 makes Liger's kernels
runnable by Triton's interpreter.
"""
from cflib.ops import interpreter  # noqa: F401  (side effect only under TRITON_INTERPRET=1)
