"""Committed notebooks: no outputs except nbval's references, and the kernel name every machine has.

    python -m cflib.lab.nbclean notebooks/*.ipynb           # clean in place (`make strip`)
    python -m cflib.lab.nbclean --check notebooks/*.ipynb   # list what is wrong; exit 1 if anything is

A notebook saved in JupyterLab carries its outputs, widget state and the
`cflib` kernel name (cflib.lab); the committed one carries none of them, so
papermill and nbval run it anywhere. Cells marked NBVAL_CHECK_OUTPUT keep
their output: it is what nbval compares a fresh run against.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat

from cflib.atomic import atomic_file
from cflib.errors import shown
from cflib.jsonio import parse_json, read_bounded

# A notebook saved with its outputs (plots, widget state) outgrows the 64 MiB cflib reads in other JSON documents;
# this bounds what one file can make nbclean hold.
MAX_NOTEBOOK_BYTES = 256 * 2**20

PORTABLE_KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
NBVAL_MARK = "NBVAL_CHECK_OUTPUT"


class NotebookError(ValueError):
    """A file nbclean cannot read or write as a notebook; the message names the file and what is wrong."""


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """The notebook in `path` as nbformat 4, checked against its schema, or NotebookError naming the file. A
    symbolic link is refused: cleaning rewrites the file in place, which must never reach outside the folder."""
    if path.is_symlink():
        raise NotebookError(f"{path}: a symbolic link (to {os.readlink(path)}); nbclean reads and rewrites "
                            "notebooks in place, never through a link")
    # Bounded in nesting too: nbformat's conversion and schema check recurse through it.
    value = parse_json(read_bounded(path, MAX_NOTEBOOK_BYTES, NotebookError, "notebook"), str(path), NotebookError,
                       MAX_NOTEBOOK_BYTES)
    version = value.get("nbformat") if isinstance(value, dict) else None
    if type(version) is not int or version not in nbformat.versions:
        raise NotebookError(f"{path}: no nbformat version ({shown(version)}), not a notebook")
    try:
        # What nbformat.reads does after parsing: a cell's source stored as a list of lines becomes one string.
        read = nbformat.versions[version].to_notebook_json(value, minor=value.get("nbformat_minor", 0))
        notebook = nbformat.convert(read, 4)
        nbformat.validate(notebook)
    except nbformat.ValidationError as err:  # schema errors carry the offending value: shown() keeps the line short
        where = "/".join(str(key) for key in err.absolute_path) or "the document"
        raise NotebookError(f"{path}: not a valid notebook at {where}: {shown(err.message)}") from None
    except (AttributeError, KeyError, TypeError, ValueError) as err:  # reading or converting what is no notebook
        raise NotebookError(f"{path}: cannot be read as an nbformat {version} notebook ({shown(err)})") from None
    return notebook


def write_notebook(notebook: nbformat.NotebookNode, path: Path) -> None:
    """`notebook` written over `path` whole or not at all: encoded before anything is written (text that is not
    UTF-8, such as a lone surrogate, would otherwise leave an empty file), then renamed over it."""
    try:
        text = nbformat.writes(notebook)
        data = (text if text.endswith("\n") else text + "\n").encode("utf-8")
    except UnicodeError as err:
        raise NotebookError(f"{path}: holds text that cannot be written as UTF-8 ({err}); the file was left as it "
                            "was") from None
    with atomic_file(path) as staging:
        staging.write_bytes(data)


# What a run leaves on each cell (papermill's timings and status, the kernel's execution times): not the notebook's.
RUN_METADATA = {"papermill", "execution"}


def problems(notebook: nbformat.NotebookNode) -> list[str]:
    """What keeps this notebook from being committed, one line each (empty: nothing)."""
    found = []
    kernel = notebook.metadata.get("kernelspec", {}).get("name")
    if kernel != PORTABLE_KERNELSPEC["name"]:
        found.append(f"kernelspec {kernel!r}: the committed notebook names {PORTABLE_KERNELSPEC['name']!r}")
    language = notebook.metadata.get("language_info", {}).get("name")
    if language != "python":
        # JupyterLab starts the one kernel of this language when the notebook's kernel name is not offered.
        found.append(f"language_info name {language!r}: the committed notebook names 'python'")
    if "widgets" in notebook.metadata:
        found.append("saved widget state in the notebook metadata")
    if "papermill" in notebook.metadata:
        found.append("papermill's record of a run in the notebook metadata")
    for index, cell in enumerate(notebook.cells):
        run_keys = sorted(RUN_METADATA & set(cell.metadata))
        if run_keys:
            found.append(f"cell {index} carries a run's metadata ({', '.join(run_keys)})")
        if cell.cell_type != "code" or NBVAL_MARK in cell.source:
            continue
        if cell.outputs or cell.execution_count is not None:
            first_line = cell.source.splitlines()[0] if cell.source else ""
            found.append(f"cell {index} ({first_line[:50]!r}) has outputs or an execution count")
    return found


def clean(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook as it is committed (changed in place and returned)."""
    notebook.metadata["kernelspec"] = dict(PORTABLE_KERNELSPEC)
    notebook.metadata["language_info"] = {"name": "python"}
    notebook.metadata.pop("widgets", None)
    notebook.metadata.pop("papermill", None)
    for cell in notebook.cells:
        for key in RUN_METADATA:
            cell.metadata.pop(key, None)
        if cell.metadata.get("tags") == []:  # papermill's: an empty list says nothing
            del cell.metadata["tags"]
        if cell.cell_type == "code" and NBVAL_MARK not in cell.source:
            cell.outputs = []
            cell.execution_count = None
    return notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cflib.lab.nbclean", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs cleaning")
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    failed = 0
    for path in args.notebooks:
        try:
            failed += _one(path, args.check)
        except (NotebookError, OSError) as err:  # one bad file is named; the others are still checked or cleaned
            print(f"nbclean: {err}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _one(path: Path, check: bool) -> bool:
    """Check (print its problems) or clean one notebook; whether it counts against the exit status."""
    notebook = read_notebook(path)
    found = problems(notebook)
    if check:
        for line in found:
            print(f"{path}: {line}")
        return bool(found)
    if found:
        write_notebook(clean(notebook), path)
        print(f"{path}: cleaned ({len(found)} problem(s))")
    return False


if __name__ == "__main__":
    sys.exit(main())
