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
import sys
from pathlib import Path

import nbformat

from cflib.jobs import one_line_errors

PORTABLE_KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
NBVAL_MARK = "NBVAL_CHECK_OUTPUT"


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
    for index, cell in enumerate(notebook.cells):
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
    for cell in notebook.cells:
        if cell.cell_type == "code" and NBVAL_MARK not in cell.source:
            cell.outputs = []
            cell.execution_count = None
    return notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cflib.lab.nbclean", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs cleaning")
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    dirty = 0
    for path in args.notebooks:
        with one_line_errors(f"nbclean: {path}", ValueError):  # ValueError: nbformat's "not a notebook"
            notebook = nbformat.read(path, as_version=4)
        found = problems(notebook)
        if args.check:
            dirty += bool(found)
            for line in found:
                print(f"{path}: {line}")
        elif found:
            nbformat.write(clean(notebook), path)
            print(f"{path}: cleaned ({len(found)} problem(s))")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
