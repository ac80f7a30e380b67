"""Run a prepared job: in this process, or on several through torchrun.

The notebook calls `fit(run)`. With one process it trains in place; with
more it starts `python -m torch.distributed.run ... -m cflib.train PARAMS`,
streams every rank's output back live (rank 0's progress drives the bar),
stops the whole job when any rank fails, and returns rank 0's record.

`python -m cflib.train PARAMS.json` (cflib/train/__main__.py) is the worker entry point torchrun runs;
`train` (cflib.train.start) checks and trains in one call.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record as record_errors

from cflib.atomic import write_json_atomic
from cflib.export.publish import publish_run
from cflib.export.push import check_push
from cflib.jsonio import read_json
from cflib.progress import tqdm
from cflib.train.distributed import init_from_torchrun
from cflib.train.lock import RunLock
from cflib.train.params import ParamError, TrainParams
from cflib.train.launch_failures import (
    SUMMARY_START,
    drop_agent_traceback,
    forget_launch_dir,
    launch_error,
    read_failures,
)
from cflib.train.registered import REGISTERED_FILE, register_carried
from cflib.train.run import Run, prepare
from cflib.train.run_folder import LAUNCH_DIR, remove_dead_launch_dirs, set_aside_run, starts_over
from cflib.train.trainer import Trainer

PROGRESS = re.compile(r"^\[rank 0\] step (\d+)/(\d+) ")
REGISTERED_WHAT = "registered losses, metrics and attention backends file"


def fit(run: Run, progress: bool = True) -> dict:
    """Train a prepared run and return its record; with push_to_hub, its model is then on the Hub."""
    if run.params.push_to_hub is not None:
        check_push(run.params.push_to_hub)  # no token to push with: said before the first step, not after the last
    if not isinstance(run, Run):  # a curriculum or a dry run (cflib.train.curriculum_run) runs its own stages
        record = run.fit(progress=progress)
    else:
        if run.params.resume == "latest" and run.resume_state is None:
            run = start_over(run)
        record = Trainer(run, progress=progress).fit() if not run.launches_workers else torchrun(run, progress=progress)
    return publish_run(record, run.params.push_to_hub)


def start_over(run: Run) -> Run:
    """`resume: latest` on a run killed before its first resumable checkpoint: under the folder's lock, its files
    go to out_dir/set-aside-N/ (kept, never deleted) and the run starts from step 0 (cflib.train.run_folder)."""
    with RunLock(run.out_dir):
        if not starts_over(run.out_dir):  # another run wrote the folder since it was checked
            raise ParamError(f"out_dir {run.out_dir} changed since it was checked; prepare the run again")
        moved = set_aside_run(run.out_dir)
    print(f"out_dir {run.out_dir}: the run there was killed before its first resumable checkpoint; it starts "
          f"over, and what it left is kept in {moved}")
    return replace(run, params=replace(run.params, resume=None))


def torchrun_command(params: TrainParams, launch_dir: Path, registered: bool = False) -> list[str]:
    """torchrun on the workers' parameters (launch_dir/params.json), its logs in launch_dir/logs: without a
    log folder torchrun makes one in the system's temporary folder and never removes it. registered: the
    workers first import the registered losses, metrics and attention backends launch_dir/registered.json names."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={params.nproc_per_node}",
               "--max-restarts=0", "--monitor-interval=0.5", f"--log-dir={launch_dir / 'logs'}"]
    if params.nnodes == 1 and not params.rdzv_endpoint:
        command.append("--standalone")
    else:
        command += [f"--nnodes={params.nnodes}", f"--node-rank={params.node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={params.rdzv_endpoint}"]
    command += ["-m", "cflib.train", str(launch_dir / "params.json")]
    if registered:
        command.append(str(launch_dir / REGISTERED_FILE))
    return command


def torchrun(run: Run, progress: bool = True) -> dict:
    """Start torchrun, relay its output line by line, and collect the record rank 0 wrote. What it hands torchrun
    lives in the run folder while the job runs (open_launch_dir), and goes when it ends, however it ends."""
    created = not run.out_dir.exists()
    launch_dir = open_launch_dir(run.out_dir, run.params.node_rank)
    try:
        write_json_atomic(launch_dir / "params.json", asdict(replace(run.params, out_dir=str(run.out_dir))))
        carried = run.worker_imports or {}
        registered = bool(carried.get("losses") or carried.get("metrics") or carried.get("attention_backends"))
        if registered:  # what they import before reading their parameters (cflib.train.registered)
            write_json_atomic(launch_dir / REGISTERED_FILE, carried)
        returncode, tail, summary = relay(torchrun_command(run.params, launch_dir, registered), run, progress)
        failures = read_failures(summary)  # the ranks' error files are in the launch folder, about to go
    finally:
        close_launch_dir(launch_dir, created)
    if returncode != 0:
        raise launch_error(returncode, [forget_launch_dir(line, launch_dir) for line in tail], failures)
    if run.params.node_rank != 0:  # rank 0 lives on node 0, and so does the record
        return {"node_rank": run.params.node_rank, "world_size": run.params.world_size}
    return json.loads((run.out_dir / "record.json").read_text())


def relay(command: list[str], run: Run, progress: bool) -> tuple[int, deque[str], list[str]]:
    """Run torchrun's command, every line of its output relayed (rank 0's progress drives the bar); its exit
    status, its last lines before its failure summary, and that summary (whole: a long traceback in it would push
    the other ranks' entries out of the last lines). Whatever ends the relay ends torchrun's process group too."""
    bar = tqdm(total=run.total_steps, desc=f"train x{run.params.world_size}", unit="step", disable=not progress)
    tail: deque[str] = deque(maxlen=60)
    summary: list[str] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // run.params.nproc_per_node)))
    # Its own session: on any exit path the whole process group can be ended, no orphans.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True, preexec_fn=_terminate_with_parent)
    try:
        for line in process.stdout:
            if summary or line.startswith(SUMMARY_START):
                if not summary:
                    drop_agent_traceback(tail)
                summary.append(line)
            else:
                tail.append(line)
            found = PROGRESS.match(line)
            if found:
                bar.n = int(found.group(1))
                bar.refresh()
            tqdm.write(line.rstrip("\n"))
        return process.wait(), tail, summary
    finally:
        if process.poll() is None:
            _stop(process)
        bar.close()


def open_launch_dir(out_dir: Path, node_rank: int) -> Path:
    """The launcher's folder in the run folder, `out_dir/.torchrun-node<N>-<host>-<pid>`: the workers' parameters
    and torchrun's logs, never the system's temporary folder. Its own name per launcher, so a second launch into
    the folder (which rank 0's lock then refuses) never touches a running one's; killed launchers' folders, their
    process gone from this host, are removed here (remove_dead_launch_dirs)."""
    remove_dead_launch_dirs(out_dir)
    folder = out_dir / f"{LAUNCH_DIR}-node{node_rank}-{socket.gethostname()}-{os.getpid()}"
    folder.mkdir(parents=True)
    return folder


def close_launch_dir(folder: Path, created_out_dir: bool) -> None:
    """The launcher's folder removed; out_dir too when the launcher made it and no worker wrote in it."""
    shutil.rmtree(folder, ignore_errors=True)
    if created_out_dir:
        with contextlib.suppress(OSError):  # not empty: the run's own files
            folder.parent.rmdir()


def _terminate_with_parent() -> None:
    """In the torchrun child: SIGTERM when the launching process dies (a killed kernel, say),
    which torchrun answers by stopping its workers. Linux only; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@record_errors  # a failing rank's traceback reaches torchrun's summary
def worker(params_file: str, registered_file: str | None = None) -> None:
    if registered_file is not None:  # before the parameters: loss_type, best_metric, attention_backend may name them
        register_carried(read_json(registered_file, ParamError, REGISTERED_WHAT))
    params = TrainParams.from_dict(read_json(params_file, ParamError, "parameter file"), source=params_file)
    if params.out_dir is None:
        raise ParamError("out_dir must be set when torchrun starts the workers directly")
    device_type = "cuda" if params.device == "cuda" or (params.device == "auto" and torch.cuda.is_available()) else "cpu"
    ctx = init_from_torchrun(device_type, params.collective_timeout_s)
    print(f"[rank {ctx.rank}] pid {os.getpid()} on {socket.gethostname()}, {device_type}", flush=True)
    try:
        # Rank 0 prepares first: it may write the embedded data set the others then read.
        if not ctx.is_main:
            ctx.barrier()
        run = prepare(params, ctx)
        if ctx.is_main:
            ctx.barrier()
        Trainer(run, progress=False).fit()
    finally:
        dist.destroy_process_group()
