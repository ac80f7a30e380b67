"""`python -m cflib.lab.nbclean` given a missing file or one that is not a notebook: one line naming it and a
non-zero status, never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("name, content, words", [
    ("missing.ipynb", None, ["missing.ipynb", "No such file"]),
    ("notes.ipynb", "not json\n", ["notes.ipynb", "not appear to be JSON"]),
])
def test_nbclean_names_the_notebook_it_cannot_read(tmp_path, name, content, words):
    if content is not None:
        (tmp_path / name).write_text(content)
    done = subprocess.run([sys.executable, "-m", "cflib.lab.nbclean", "--check", str(tmp_path / name)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last, last
