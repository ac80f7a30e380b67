"""outputs/records holds evidence, not code: what runs wrote (JSON, logs, executed notebooks, profiles, figures) and
the READMEs that say what made it. A probe lives in benchmarks/, or, for a one-off, in git history, named where its
record is described with the commit that holds it (`git show COMMIT:PATH`), and each such name leads to a file."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cflib.paths import project_root

ROOT = project_root()
RECORDS = ROOT / "outputs" / "records"
CODE_SUFFIXES = {".py", ".sh", ".bash", ".patch", ".diff", ".c", ".cpp", ".cu"}
GIT_SHOW = re.compile(r"`git\s+show\s+([0-9a-f]{7,40}):([^`\s]+)`")
# The pages that name probes by their commit: the records' READMEs and the manual.
CITING = [*sorted(RECORDS.rglob("*.md")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_files(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                  if path.is_file() and path.suffix in CODE_SUFFIXES)


def test_records_hold_no_code():
    assert any(RECORDS.rglob("*.json")), "no records found under outputs/records"
    found = code_files(RECORDS)
    assert not found, ("outputs/records holds code: a probe lives in benchmarks/, or in git history, named in its "
                       f"record's README with its commit (`git show COMMIT:PATH`): {found}")


def test_the_check_finds_code_in_a_record_folder(tmp_path):
    (tmp_path / "run" / "profiles").mkdir(parents=True)
    for name in ("record.json", "run.log", "probe.py", "call.sh", "change.patch", "README.md", "profiles/step.txt"):
        (tmp_path / "run" / name).write_text("x")
    assert code_files(tmp_path) == ["run/call.sh", "run/change.patch", "run/probe.py"]


def git_show_citations(pages: list[Path]) -> list[tuple[str, str, str]]:
    """(page, commit, path) of every `git show COMMIT:PATH` the pages hold, a line break inside it allowed."""
    return [(page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name, commit, path)
            for page in pages for commit, path in GIT_SHOW.findall(page.read_text())]


def test_citations_by_commit_are_found_across_a_line_break(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("made by `git show abc1234:outputs/x/probe.py`, and `git\nshow 0123456789:cflib/y.py`; "
                    "`git show COMMIT:PATH` is the form\n")
    assert git_show_citations([page]) == [("README.md", "abc1234", "outputs/x/probe.py"),
                                          ("README.md", "0123456789", "cflib/y.py")]


@pytest.mark.slow
def test_every_probe_named_by_its_commit_is_in_git_history():
    cited = git_show_citations(CITING)
    assert len(cited) > 50, "too few `git show COMMIT:PATH` found (is GIT_SHOW still right?)"
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: the commits the records name are not all here")
    checked = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True,
                             check=True, input="".join(f"{commit}:{path}\n" for _, commit, path in cited))
    answers = checked.stdout.splitlines()
    assert len(answers) == len(cited), checked.stdout
    missing = [f"{page}: {commit}:{path}" for (page, commit, path), answer in zip(cited, answers)
               if answer.endswith(" missing")]
    assert not missing, "named by a commit that does not hold them:\n" + "\n".join(missing)
