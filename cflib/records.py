"""Run records and metrics: what ran, on what, with which kernels, and what came out."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .paths import project_root


class MetricsLog:
    """Append-only JSON lines; each line is flushed so a crash loses at most one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step`: a resumed run logs those steps again."""
        if self.path.is_file():
            kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= step]
            with open(self.path, "w") as out:
                out.writelines(json.dumps(row, default=str) + "\n" for row in kept)

    def write(self, **row: Any) -> dict:
        with open(self.path, "a") as out:
            out.write(json.dumps(row, default=str) + "\n")
        return row


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=project_root(), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def framework_versions() -> dict[str, Any]:
    # A copied working tree (a GPU box's) names its commit in CFLIB_COMMIT: its .git, if any, may be stale.
    named = os.environ.get("CFLIB_COMMIT")
    status = None if named else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "cflib_commit": named or _git("rev-parse", "HEAD"),
        "cflib_dirty": bool(status) if status is not None else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda_runtime": torch.version.cuda,
        "triton": _package_version("triton"),
        "liger_kernel": _package_version("liger-kernel"),
        "safetensors": _package_version("safetensors"),
        "platform": platform.platform(),
    }


def device_info(device: torch.device, count: int = 1) -> dict[str, Any]:
    """The device model, and how many of them the run used (one per rank)."""
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": count,
                "capability": list(torch.cuda.get_device_capability(device)),
                "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 2)}
    return {"type": device.type, "name": platform.processor() or platform.machine(), "count": count,
            "threads": torch.get_num_threads()}
