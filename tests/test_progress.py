"""cflib.progress: a bar wherever a person may watch it, none in a notebook kernel run headless."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from cflib.progress import headless_kernel, tqdm


@pytest.mark.parametrize("server_session, allow_stdin, headless", [
    (True, True, False),    # JupyterLab
    (False, True, False),   # VS Code, Colab: a person's frontend without a Jupyter server's session name
    (True, False, True),    # papermill started from a JupyterLab cell: nbclient refuses stdin
    (False, False, True),   # papermill
])
def test_a_bar_is_off_only_where_the_running_request_refuses_input(monkeypatch, server_session, allow_stdin,
                                                                   headless):
    kernel = SimpleNamespace(get_parent=lambda: {"content": {"allow_stdin": allow_stdin}})
    monkeypatch.setattr("IPython.get_ipython", lambda: SimpleNamespace(kernel=kernel))
    monkeypatch.setitem(sys.modules, "ipykernel", sys.modules.get("ipykernel") or SimpleNamespace())
    if server_session:
        monkeypatch.setenv("JPY_SESSION_NAME", "notebooks/train_sft.ipynb")
    else:
        monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert headless_kernel() is headless
    assert tqdm(range(3), disable=False).disable is headless


def test_outside_a_notebook_kernel_the_bar_is_tqdm_s_own():
    assert not headless_kernel() and not tqdm(range(3)).disable
