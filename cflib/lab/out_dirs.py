"""Where a notebook job of cflib.lab writes: a new timestamped folder, or the one asked for unless it already
holds that job's output."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from cflib.errors import ParamError
from cflib.paths import resolve_path


def job_out_dir(out_dir: str | None, kind: str, output: str, holds: str) -> Path:
    """out_dir, or outputs/<kind>/<time> when None; refused when it already holds `output` (described as
    `holds` in the message), so no job writes over another's."""
    if out_dir is None:
        return resolve_path(f"outputs/{kind}/{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")
    folder = resolve_path(out_dir)
    if (folder / output).exists():
        raise ParamError(f"out_dir {folder} already holds {holds}; choose another out_dir")
    return folder
