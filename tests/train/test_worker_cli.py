"""`python -m cflib.train PARAMS.json` (the torchrun worker) given no file, a missing one or one that is not JSON:
one line naming the culprit and a non-zero status, before any process group starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("name, content, words", [
    (None, None, ["usage: python -m cflib.train PARAMS.json"]),
    ("missing.json", None, ["missing.json", "no such JSON parameter file"]),
    ("broken.json", "{", ["broken.json", "not valid JSON"]),
], ids=["no-argument", "missing-file", "not-json"])
def test_bad_worker_input_ends_in_one_line(tmp_path, name, content, words):
    arguments = [] if name is None else [str(tmp_path / name)]
    if content is not None:
        (tmp_path / name).write_text(content)
    done = subprocess.run([sys.executable, "-m", "cflib.train", *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert all(word in last for word in words), last
