"""`python -m cflib.lab.nbclean` given a missing file or one that is not a notebook: one line naming it and a
non-zero status, never a traceback. A commit hook, it starts without torch: the lab's names load on first use."""
from __future__ import annotations

import json
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
    assert "missing.ipynb" in last and "no such notebook" in last, last


def test_nbclean_names_the_notebook_that_is_not_json(tmp_path, capsys):
    """The same exit as above, in this process: one line on stderr and exit status 1."""
    (tmp_path / "notes.ipynb").write_text("not json\n")
    assert nbclean.main(["--check", str(tmp_path / "notes.ipynb")]) == 1
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "notes.ipynb" in line and "not valid JSON" in line, line


@pytest.mark.slow
def test_nbclean_starts_without_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, cflib.lab.nbclean; print(sorted(m for m in sys.modules "
                           "if m.split('.')[0] in ('torch', 'matplotlib', 'transformers')))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout[:500] + done.stderr[-2000:]


def notebook(**metadata) -> dict:
    """A small valid notebook (nbformat 4.5) with one executed code cell, a problem nbclean cleans."""
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": metadata, "cells": [
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": "# notes"},
        {"cell_type": "code", "id": "b", "metadata": {}, "source": ["1 +\n", " 1"], "execution_count": 1,
         "outputs": []}]}


def notebook_text(**metadata) -> str:
    return json.dumps(notebook(**metadata), indent=1)


def without_outputs() -> str:
    document = notebook()
    del document["cells"][1]["outputs"]
    return json.dumps(document)


@pytest.mark.parametrize(("text", "said"), [
    pytest.param("{}", "no nbformat version", id="empty-object"),
    pytest.param("[1, 2]", "no nbformat version", id="a-list"),
    pytest.param(json.dumps({**notebook(), "cells": {}}), "not a valid notebook at cells: \"{} is not of",
                 id="cells-an-object"),
    pytest.param(without_outputs(), "not a valid notebook at cells/1: \"'outputs' is a required",
                 id="code-cell-without-outputs"),
    pytest.param(notebook_text(kernelspec="str"), "not a valid notebook at metadata/kernelspec",
                 id="kernelspec-a-string"),
    pytest.param("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels", id="nested-deep"),
])
def test_a_file_that_is_no_notebook_is_named_and_the_others_are_still_cleaned(tmp_path, capsys, text, said):
    (tmp_path / "bad.ipynb").write_text(text)
    (tmp_path / "good.ipynb").write_text(notebook_text(kernelspec={"name": "cflib", "display_name": "cflib"}))
    for check in (["--check"], []):
        assert nbclean.main([*check, str(tmp_path / "bad.ipynb"), str(tmp_path / "good.ipynb")]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"nbclean: {tmp_path / 'bad.ipynb'}: " in err and said in err, err
        assert len(err.splitlines()) == 1, err
    assert (tmp_path / "bad.ipynb").read_text() == text  # never "cleaned" and written back
    assert nbclean.main(["--check", str(tmp_path / "good.ipynb")]) == 0  # the good one was cleaned all the same


def test_a_notebook_that_cannot_be_written_as_utf8_is_left_whole(tmp_path, capsys):
    """A lone surrogate ("\\ud800" in the JSON) reads but cannot be encoded: the file keeps every byte."""
    text = notebook_text().replace('"# notes"', '"# notes \\ud800"')
    assert "\\ud800" in text
    (tmp_path / "notes.ipynb").write_text(text)
    assert nbclean.main([str(tmp_path / "notes.ipynb")]) == 1
    err = capsys.readouterr().err
    assert f"nbclean: {tmp_path / 'notes.ipynb'}: holds text that cannot be written as UTF-8" in err, err
    assert (tmp_path / "notes.ipynb").read_text() == text and [p.name for p in tmp_path.iterdir()] == ["notes.ipynb"]


def test_a_notebook_that_is_a_symbolic_link_is_refused_never_written_through(tmp_path, capsys):
    outside = tmp_path / "outside.ipynb"
    outside.write_text(notebook_text(kernelspec={"name": "cflib", "display_name": "cflib"}))
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "notes.ipynb").symlink_to(outside)
    before = outside.read_bytes()
    for check in (["--check"], []):
        assert nbclean.main([*check, str(tmp_path / "repo" / "notes.ipynb")]) == 1
        err = capsys.readouterr().err
        assert f"notes.ipynb: a symbolic link (to {outside})" in err, err
    assert outside.read_bytes() == before and (tmp_path / "repo" / "notes.ipynb").is_symlink()


def test_a_run_s_metadata_is_taken_out_and_the_checked_outputs_stay(tmp_path):
    """What `make references` leaves after papermill ran a notebook in place: papermill's and the kernel's timings
    go, the outputs nbval checks stay."""
    document = notebook(kernelspec={"name": "python3", "display_name": "Python 3", "language": "python"},
                        language_info={"name": "python"}, papermill={"duration": 2.5, "parameters": {}})
    timing = {"papermill": {"duration": 0.01, "status": "completed"}, "execution": {"iopub.status.idle": "t"},
              "tags": []}
    document["cells"][0]["metadata"] = dict(timing)
    document["cells"].append({"cell_type": "code", "id": "c", "metadata": dict(timing), "execution_count": 2,
                              "source": "# NBVAL_CHECK_OUTPUT\nprint('checked')",
                              "outputs": [{"output_type": "stream", "name": "stdout", "text": "checked\n"}]})
    path = tmp_path / "run.ipynb"
    path.write_text(json.dumps(document))
    assert any("papermill's record" in line for line in nbclean.problems(nbclean.read_notebook(path)))
    assert nbclean.main([str(path)]) == 0
    cleaned = json.loads(path.read_text())
    assert "papermill" not in cleaned["metadata"] and all(cell["metadata"] == {} for cell in cleaned["cells"])
    assert "".join(cleaned["cells"][2]["outputs"][0]["text"]) == "checked\n" and cleaned["cells"][1]["outputs"] == []
    assert nbclean.problems(nbclean.read_notebook(path)) == []
