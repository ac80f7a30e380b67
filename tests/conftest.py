"""Without a GPU, every Triton kernel (Liger's and cflib's) runs in Triton's interpreter.

Set before anything imports Triton: the interpreter is chosen when a kernel is defined.
Notebooks started by these tests inherit it through the environment.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
