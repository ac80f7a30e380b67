"""`python -m cflib.lab.nbclean` given a missing file or one that is not a notebook: one line naming it and a
non-zero status, never a traceback. A commit hook, it starts without torch: the lab's names load on first use."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cflib.lab import nbclean

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_nbclean_names_the_notebook_it_cannot_find(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cflib.lab.nbclean", "--check", str(tmp_path / "missing.ipynb")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "missing.ipynb" in last and "No such file" in last, last


def test_nbclean_names_the_notebook_that_is_not_json(tmp_path):
    """The same exit as above, in this process: SystemExit with the one line the interpreter prints."""
    (tmp_path / "notes.ipynb").write_text("not json\n")
    with pytest.raises(SystemExit) as exited:
        nbclean.main(["--check", str(tmp_path / "notes.ipynb")])
    line = str(exited.value)
    assert "\n" not in line and "notes.ipynb" in line and "not appear to be JSON" in line, line


@pytest.mark.slow
def test_nbclean_starts_without_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, cflib.lab.nbclean; print(sorted(m for m in sys.modules "
                           "if m.split('.')[0] in ('torch', 'matplotlib', 'transformers')))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout[:500] + done.stderr[-2000:]
