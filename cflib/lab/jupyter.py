"""JupyterLab from the project's environment, the notebooks folder open, on the project's kernel.

`make lab` runs `python -m cflib.lab [jupyter lab options]`.

Two kernel names coexist. The committed notebooks name `python3`, the kernel
every Jupyter installation has, so papermill and nbval run them anywhere (CI,
the GPU machine) without registering anything. JupyterLab started here offers
one kernel only, `cflib` (the project's .venv, registered by `make setup`);
finding no `python3`, JupyterLab starts the one Python kernel it has for every
notebook. Saving a notebook in JupyterLab writes `cflib` into its metadata,
with its outputs: `make strip` (cflib.lab.nbclean) writes both back, and
tests/lab/test_notebooks.py fails until it has.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

from cflib.paths import project_root

KERNEL_NAME = "cflib"


class LabError(RuntimeError):
    """JupyterLab cannot start as the project wants it; the message says what to do."""


def check_kernel() -> None:
    """A LabError saying how to register the project kernel, unless it is registered and runnable."""
    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        raise LabError(f"no Jupyter kernel named {KERNEL_NAME!r} in {sys.prefix}: run `make setup`, which "
                       f"registers it ({sys.executable} -m ipykernel install --sys-prefix --name {KERNEL_NAME})"
                       ) from None
    python = Path(spec.argv[0])
    if not python.exists():
        raise LabError(f"kernel {KERNEL_NAME!r} ({spec.resource_dir}) runs {python}, which is gone: "
                       "run `make setup` again")


def lab_command(root_dir: str | Path | None = None, open_path: str = "notebooks", *options: str) -> list[str]:
    """The command that starts JupyterLab at root_dir (the project) with open_path shown, the project kernel only."""
    check_kernel()
    root = Path(root_dir) if root_dir is not None else project_root()
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}",
               f"--LabApp.default_url=/lab/tree/{open_path}",
               f"--KernelSpecManager.allowed_kernelspecs={KERNEL_NAME}",
               f"--MappingKernelManager.default_kernel_name={KERNEL_NAME}"]
    if os.geteuid() == 0:  # containers and CI run as root; Jupyter refuses that unless told
        command.append("--ServerApp.allow_root=True")
    return command + list(options)


def main(argv: list[str] | None = None) -> None:
    try:
        command = lab_command(None, "notebooks", *(sys.argv[1:] if argv is None else argv))
    except LabError as err:
        sys.exit(f"make lab: {err}")
    os.execv(command[0], command)  # JupyterLab takes over this process: Ctrl-C reaches it directly

