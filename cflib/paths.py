"""Where relative paths point: the project root, from a notebook or the top level alike."""
from __future__ import annotations

from pathlib import Path


def project_root() -> Path:
    """The checkout holding cflib (editable install), else the nearest ancestor of cwd with pyproject.toml."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():
        return checkout
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    return Path.cwd()


def resolve_path(path: str | Path) -> Path:
    path = Path(path).expanduser()
    return path if path.is_absolute() else project_root() / path
