"""cflib.lazy: the package faces whose names load on first use (cflib.lab, cflib.bench)."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", ["cflib.lab", "cflib.bench"])
def test_every_name_of_a_face_loads_from_its_module(package):
    face = importlib.import_module(package)
    for name in face.__all__:
        value = getattr(face, name)
        assert value.__name__ == name and value.__module__.startswith(f"{package}."), name
    assert set(face.__all__) <= set(dir(face))
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'plot_everything'"):
        face.plot_everything


@pytest.mark.slow  # a process of its own
def test_a_table_of_a_record_is_printed_without_importing_torch():
    record = ROOT / "outputs" / "records" / "throughput_200m_h100.json"
    done = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = ['cflib.bench', 'perf-table', "
                           f"{str(record)!r}]; runpy.run_module('cflib.bench', run_name='__main__'); "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib')))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| production |" in done.stdout and done.stdout.strip().endswith("[]"), done.stdout[-500:]
