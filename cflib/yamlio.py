"""YAML documents read safely, with errors that name the file and the kind of document it was meant to be."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: str | Path, error: type[ValueError], what: str) -> Any:
    """A YAML document (safe loader), or `error` naming the file."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid YAML ({err})") from None
