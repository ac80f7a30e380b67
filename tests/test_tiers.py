"""`make test-fast` leaves out the tests marked slow: every test that starts torchrun, a papermill kernel,
JupyterLab, a browser or a run it kills must carry the mark (pyproject.toml registers it), or test-fast
would slowly become `make test`.

A test starts one when its own code does, or a function or fixture of its module that it calls or takes does.

A test that skips where a package is missing (pytest.importorskip) names one that `make setup` and environment.yml
install, or it would never run on a fresh install.
"""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from cflib.paths import project_root

TESTS = project_root() / "tests"
BENCHMARK_TESTS = project_root() / "benchmarks" / "tests"  # make test runs them, with the same mark
# What starts one: papermill's kernel, Playwright's browser, a child process (a command line run whole, or one to kill); or a run launched (train,
# fit) with two or more ranks or nodes, which is torchrun (parameters checked alone start nothing).
STARTS_SLOW = re.compile(r"papermill\.execute_notebook|sync_playwright|subprocess\.(?:Popen|run|check_output|check_call)")
RANKS = re.compile(r"\b(?:nproc_per_node|nnodes)[\"']?\s*[:=]\s*[2-9]")
LAUNCH = re.compile(r"\b(?:train|fit)\(")


def _starts_slow(source: str) -> bool:
    return bool(STARTS_SLOW.search(source) or (RANKS.search(source) and LAUNCH.search(source)))


def _marked_slow(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d).replace("pytest.", "", 1).startswith("mark.slow") for d in decorators)


def unmarked_slow_tests(path: Path) -> list[str]:
    """The tests of `path` that start something slow without the slow mark, its module's included."""
    text = path.read_text()
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            if "mark.slow" in ast.unparse(node.value):
                return []
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    slow = {name for name, node in functions.items() if _starts_slow(ast.get_source_segment(text, node))}
    grew = True
    while grew:  # what calls, or takes as a fixture, something slow is slow
        grew = False
        for name, node in functions.items():
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in node.args.args}
            if name not in slow and used & slow:
                slow.add(name)
                grew = True
    return sorted(f"{path.relative_to(path.parents[1])}::{name}" for name in slow
                  if name.startswith("test") and not _marked_slow(functions[name].decorator_list))


def test_every_test_that_starts_something_slow_is_marked_slow():
    files = sorted(TESTS.rglob("test_*.py")) + sorted(BENCHMARK_TESTS.rglob("test_*.py"))
    assert len(files) > 20 and BENCHMARK_TESTS in {path.parent for path in files}, "no test files found"
    wrong = [found for path in files for found in unmarked_slow_tests(path)]
    assert not wrong, "mark these @pytest.mark.slow (make test-fast leaves them out):\n" + "\n".join(wrong)


def test_the_slow_mark_is_registered():
    pyproject = (project_root() / "pyproject.toml").read_text()
    assert re.search(r'^markers = \[.*"slow: ', pyproject, re.M), "pyproject.toml registers no slow marker"


def test_the_check_finds_slow_tests_through_helpers_and_fixtures(tmp_path):
    (tmp_path / "tests").mkdir()
    path = tmp_path / "tests" / "test_sample.py"
    # Written in pieces so that this file's own functions start nothing slow.
    path.write_text("\n".join([
        "import pytest", "",
        "def start_and_kill():", "    subprocess.Pop" "en(['x'])", "",
        "@pytest.fixture", "def browser():", "    return sync_play" "wright()", "",
        "def test_direct():", "    papermill.execute_" "notebook('a', 'b')", "",
        "def test_through_helper():", "    start_and_kill()", "",
        "def test_through_fixture(browser):", "    pass", "",
        "@pytest.mark.slow", "def test_marked():", "    start_and_kill()", "",
        "def test_one_process():", "    train({'nproc_per_" "node': 1})", "",
        "def test_two_ranks_checked_not_run():", "    TrainParams.from_dict({'nproc_per_" "node': 2})", "",
        "def test_two_ranks_run():", "    params = {'nnodes" "': 2}", "    fit(prepare(params))", ""]))
    assert unmarked_slow_tests(path) == ["tests/test_sample.py::" + name for name in (
        "test_direct", "test_through_fixture", "test_through_helper", "test_two_ranks_run")]
    path.write_text("import pytest\npytestmark = pytest.mark.slow\n\n"
                    "def test_direct():\n    subprocess.Pop" "en(['x'])\n")
    assert unmarked_slow_tests(path) == []


SKIPPED_WITHOUT = re.compile(r"importorskip\(\s*[\"']([\w.]+)[\"']")


def _distribution(requirement: str) -> str:
    """A requirement's distribution as an import name compares with it: lower case, `-` for `_` and `.`."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def installed_by(extras: list[str]) -> set[str]:
    """The distributions cflib's dependencies and `extras` install."""
    project = tomllib.loads((project_root() / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]
    return {_distribution(requirement) for requirement in requirements}


def test_a_test_skips_only_without_a_package_that_set_up_installs():
    makefile = re.search(r'pip install .*-e "\.\[([\w,]+)\]"', (project_root() / "Makefile").read_text())
    environment = re.search(r"-e \.\[([\w,]+)\]", (project_root() / "environment.yml").read_text())
    files = sorted(TESTS.rglob("*.py")) + sorted(BENCHMARK_TESTS.rglob("*.py"))
    skipped = {module.split(".")[0] for path in files for module in SKIPPED_WITHOUT.findall(path.read_text())}
    assert "transformers" in skipped, "no importorskip found"
    for where, found in (("the Makefile's setup", makefile), ("environment.yml", environment)):
        assert found, f"{where} installs no extras of the project"
        missing = sorted(m for m in skipped if _distribution(m) not in installed_by(found.group(1).split(",")))
        assert not missing, f"tests skip without {missing}, which {where} never installs: add to the test extra"
