"""What ended a multi-process job, read from torchrun's failure summary and the ranks' error files.

torchrun names as "Root Cause" the earliest failure by whole seconds, ranks in order on a tie: often a rank it
stopped itself (SIGTERM) or one whose collective lost the rank that really died. `launch_error` opens with the
failure that ended the job instead (a rank killed by a signal from outside, else a rank's own exception), then how
the others ended, then torchrun's last lines, with no path into the launch folder, which is gone by then.
"""
from __future__ import annotations

import contextlib
import json
import re
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path

# torchrun's failure summary: the exception its agent ends with, then one block of fields per failed rank.
SUMMARY_START = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
SUMMARY_FIELD = re.compile(r"^  (rank|exitcode|error_file)\s*: (.*)$")
# A rank whose collective lost its peer failed because another rank ended first: a consequence, not the cause.
PEER_LOST = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|remote process exited", re.IGNORECASE)
# What usually sends a signal that ends a rank (torchrun itself sends SIGTERM to the others once one fails).
SIGNAL_CAUSES = {
    signal.SIGKILL: "killed from outside, often the out-of-memory killer (see `dmesg` or the job's memory limit)",
    signal.SIGSEGV: "a crash in native code (a segmentation fault)",
    signal.SIGABRT: "aborted by native code (a failed check or an uncaught C++ exception)",
    signal.SIGBUS: "a bus error, often shared memory (/dev/shm) running out",
    signal.SIGTERM: "asked to stop from outside (a scheduler's preemption or a kill, say)",
    signal.SIGINT: "interrupted",
}


class LaunchError(RuntimeError):
    """A multi-process job that did not finish; the message opens with the rank whose failure ended it."""


@dataclass(frozen=True)
class RankFailure:
    """One failed rank as torchrun's summary lists it, with what its error file held (read while it existed)."""
    rank: int
    exitcode: int  # negative: the signal that ended it
    error: str | None = None  # "ValueError: ...": the Python exception it recorded
    traceback: str | None = None
    written_at: float | None = None  # the error file's time: finer than the whole seconds torchrun compares

    @property
    def killed_by(self) -> signal.Signals | None:
        """The signal that ended the rank, if one did."""
        with contextlib.suppress(ValueError):
            return signal.Signals(-self.exitcode) if self.exitcode < 0 else None
        return None


def drop_agent_traceback(tail: deque[str]) -> None:
    """torchrun's own traceback, which ends in its failure summary, out of the last lines: it only shows where
    torchrun raised. The workers have ended by then, so it is the last traceback in the lines."""
    lines = list(tail)
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:
        tail.clear()
        tail.extend(lines[:starts[-1]])


def read_failures(summary: list[str]) -> list[RankFailure]:
    """The failed ranks torchrun's summary lists, in its order; each one's error file, where it wrote one, read now
    (its time and its exception), while the launch folder holding it still exists."""
    failures, fields = [], {}
    for line in summary:
        found = SUMMARY_FIELD.match(line)
        if found:
            fields[found.group(1)] = found.group(2).strip()
            if found.group(1) == "error_file":  # a rank's last field before its traceback
                with contextlib.suppress(KeyError, ValueError, IndexError):
                    failures.append(rank_failure(int(fields["rank"].split()[0]),
                                                 int(fields["exitcode"].split()[0]), Path(fields["error_file"])))
                fields = {}
    return failures


def rank_failure(rank: int, exitcode: int, error_file: Path) -> RankFailure:
    """One rank's failure, with its error file's exception when it wrote one (torchrun's @record format)."""
    try:
        message = json.loads(error_file.read_text())["message"]
        written_at = error_file.stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError):  # none (a signal leaves none), or unreadable
        return RankFailure(rank, exitcode)
    if not isinstance(message, dict):
        return RankFailure(rank, exitcode, error=str(message), written_at=written_at)
    callstack = message.get("extraInfo", {}).get("py_callstack")
    return RankFailure(rank, exitcode, error=message.get("message"), traceback=callstack, written_at=written_at)


def first_cause(failures: list[RankFailure]) -> RankFailure | None:
    """The failure that ended the job. torchrun's own "Root Cause" is the earliest by whole seconds, ranks in
    order on a tie, so a rank it stopped with SIGTERM, or whose collective lost the rank that died, often takes
    the place of the one that really died. Here, in order: a rank ended by any other signal (nothing in the job
    sends one), a rank's own exception or exit code, one that lost its peer, one stopped by SIGTERM; the earliest
    error file first within each."""
    def rank_of(failure: RankFailure) -> tuple:
        if failure.killed_by is not None:
            kind = 3 if failure.killed_by == signal.SIGTERM else 0
        else:
            kind = 2 if failure.error and PEER_LOST.search(failure.error) else 1
        return kind, failure.written_at is None, failure.written_at or 0.0, failure.rank
    return min(failures, key=rank_of, default=None)


def describe_failure(failure: RankFailure) -> str:
    """One line a person can act on: which rank, and what ended it."""
    if failure.killed_by is not None:
        cause = SIGNAL_CAUSES.get(failure.killed_by, "ended by a signal")
        return f"rank {failure.rank} died: {failure.killed_by.name} (signal {-failure.exitcode}) — {cause}"
    if failure.error:
        return f"rank {failure.rank} failed: {failure.error}"
    return f"rank {failure.rank} exited with code {failure.exitcode}"


def describe_consequence(failure: RankFailure) -> str:
    """How a rank that failed after the first one ended, in a line."""
    if failure.killed_by is not None:
        ended = f"{failure.killed_by.name} (signal {-failure.exitcode})"
        if failure.killed_by == signal.SIGTERM:
            ended += ", torchrun stopping the other ranks once one has failed"
    else:
        ended = f"exit code {failure.exitcode}"
    if failure.error:
        first_line = failure.error.splitlines()[0]
        ended += f"; it had raised {first_line[:200]}" + ("…" if len(first_line) > 200 else "")
    return f"rank {failure.rank} ended after it: {ended}"


def launch_error(returncode: int, tail: list[str], failures: list[RankFailure]) -> LaunchError:
    """The job's failure: the rank that ended it first (its traceback too), then how the others ended, then
    torchrun's last lines before its own summary, which the first lines restate."""
    lines = []
    cause = first_cause(failures)
    if cause is not None:
        lines.append(describe_failure(cause))
        if cause.traceback:
            lines.append(cause.traceback.rstrip("\n"))
        lines += [describe_consequence(other) for other in failures if other is not cause]
    lines.append(f"torchrun exited with code {returncode}; its last lines:")
    return LaunchError("\n".join(lines) + "\n" + "".join(tail))


def forget_launch_dir(line: str, launch_dir: Path) -> str:
    """A line of torchrun's output without the launch folder's paths: that folder is gone once the job ends."""
    return re.sub(re.escape(str(launch_dir)) + r"\S*", "(in the launch folder, removed when the job ended)", line)
