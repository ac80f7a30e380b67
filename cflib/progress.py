"""Progress bars where a person watches them, and how to tell.

A notebook run headless (papermill, nbval) keeps each widget as it was first drawn: a bar at 0% for good in the
executed copy. So a bar shows in a person's JupyterLab (a widget) and in a terminal (text), and not in a notebook
kernel no frontend is attached to, where the jobs' own text traces (the trainer's step lines) tell the progress.
"""
from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm as _auto_tqdm


def frontend_attached() -> bool:
    """True when a person's notebook frontend (JupyterLab, Notebook) runs this cell; False under papermill,
    nbval, nbconvert or plain Python.

    Two signals, both required. The kernel was started by a Jupyter server for
    a notebook session: jupyter_server (2.0 on) puts JPY_SESSION_NAME in the
    kernel's environment, while papermill, nbclient and nbval start their
    kernels themselves. And the request running this cell accepts input():
    a frontend a person types into does, nbclient (papermill's executor)
    refuses stdin, which also catches a papermill run started from a
    JupyterLab terminal or cell, whose kernel inherits JPY_SESSION_NAME.
    Papermill's injected-parameters cell is no signal: it is absent when
    papermill runs without parameters.
    """
    return "JPY_SESSION_NAME" in os.environ and _request_accepts_input() is True


def headless_kernel() -> bool:
    """A notebook kernel running a cell that no person watches (papermill, nbval, nbconvert): the request that
    runs it refuses input(), as nbclient's do. Any frontend a person types into accepts it (JupyterLab, VS Code,
    Colab), whether or not a Jupyter server started the kernel."""
    return "ipykernel" in sys.modules and _request_accepts_input() is False


def _request_accepts_input() -> bool | None:
    """Whether the kernel request running this code accepts input() (None: no notebook kernel runs it)."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return None
    return bool(kernel.get_parent().get("content", {}).get("allow_stdin", False))


class tqdm(_auto_tqdm):  # noqa: N801  (tqdm's own name, so callers read as tqdm's users do)
    """tqdm.auto's bar (a widget in JupyterLab, text in a terminal), off in a headless notebook kernel."""

    def __init__(self, *args, **kwargs) -> None:
        if headless_kernel():
            kwargs["disable"] = True
        super().__init__(*args, **kwargs)
