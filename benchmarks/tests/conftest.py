"""The probes' quick checks run as the project's tests do: tests/conftest.py's set-up first (Triton's interpreter
without a GPU, the cores shared among pytest's workers), then each probe importable by its file's name
(`import step_ab`), as it imports when run as `python benchmarks/step_ab.py`, and the tests' helpers
(`tiny_models`) by theirs."""
import runpy
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
runpy.run_path(str(BENCHMARKS.parent / "tests" / "conftest.py"))
for folder in (BENCHMARKS.parent / "tests", BENCHMARKS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
