"""cflib.jobs, the skeleton every job shares: where it writes, what it refuses, its record's header, its
guarded sections and its command line's last line."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from cflib.errors import KernelUnavailable, ParamError
from cflib.jobs import (
    ANYTHING,
    guarded,
    job_out_dir,
    one_line_errors,
    record_header,
    refuse_existing,
    refuse_links,
    utc_now,
)
from cflib.paths import project_root


def test_records_stamp_utc_to_the_second():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", utc_now())


def test_a_job_given_no_folder_gets_a_new_one_under_outputs_of_its_kind():
    folder = job_out_dir(None, "runs", ("record.json",), "a record", name="throughput")
    assert folder.parent == project_root() / "outputs" / "runs"
    assert re.fullmatch(r"\d{8}-\d{6}-\d{6}-throughput", folder.name) and not folder.exists()


def test_a_folder_holding_the_jobs_output_is_refused_naming_it(tmp_path):
    (tmp_path / "record.json").write_text("{}")
    with pytest.raises(ParamError, match=r"out_dir .* already holds a record \(record.json\); choose another"):
        job_out_dir(tmp_path, "runs", ("record.json",), "a record")
    assert job_out_dir(tmp_path, "chat", ("answers.jsonl",), "answers") == tmp_path
    with pytest.raises(ParamError, match=r"already holds files \(a, b, c and 3 more\)"):
        for name in "abcde":
            (tmp_path / name).write_text("")
        refuse_existing(tmp_path, ANYTHING, "files")
    with pytest.raises(ParamError, match="--out .* exists and is not a directory"):
        refuse_existing(tmp_path / "a", (), "a record", label="--out")


@dataclass
class Settings:
    steps: int = 3


def test_every_record_opens_with_the_same_header():
    header = record_header("a_job", torch.device("cpu"), "outputs/x", packages=("safetensors", "no-such-package"),
                           params=Settings())
    assert list(header) == ["job", "created_utc", "out_dir", "framework", "device", "params"]
    assert header["framework"]["torch"] == torch.__version__ and "cflib_commit" in header["framework"]
    assert header["framework"]["no_such_package"] is None and header["params"] == {"steps": 3}
    assert header["device"]["type"] == "cpu" and header["device"]["count"] == 1
    assert list(record_header("bare")) == ["job", "created_utc", "framework"]


def test_a_guarded_section_returns_its_failure_as_its_result():
    def fails(error: BaseException):
        def part():
            raise error
        return part

    assert guarded(lambda: {"ms": 1.0}) == {"status": "ok", "ms": 1.0}
    assert guarded(fails(KernelUnavailable("fa4: needs sm_90"))) == {"status": "skipped", "reason": "fa4: needs sm_90"}
    assert guarded(fails(torch.cuda.OutOfMemoryError("CUDA out of memory\nmore")))["status"] == "oom"
    failed = guarded(fails(TypeError("bad\nsecond line")))
    assert failed["status"] == "failed" and failed["reason"] == "TypeError: bad" and failed["traceback_tail"]
    with pytest.raises(KeyboardInterrupt):  # stopping the job is not a section's failure
        guarded(fails(KeyboardInterrupt()))


def test_a_command_lines_bad_input_is_one_line():
    with pytest.raises(SystemExit) as caught:
        with one_line_errors("prog", KeyError):
            raise FileNotFoundError(2, "No such file or directory", "missing.json")
    assert caught.value.code == "prog: [Errno 2] No such file or directory: 'missing.json'"
    with pytest.raises(ZeroDivisionError):  # a bug stays a traceback
        with one_line_errors("prog"):
            1 / 0


def test_a_dangling_link_in_place_of_the_jobs_output_counts_as_output(tmp_path):
    (tmp_path / "answers.jsonl").symlink_to(tmp_path.parent / "created-through-the-link.jsonl")
    with pytest.raises(ParamError, match=r"already holds answers \(answers.jsonl\)"):
        job_out_dir(tmp_path, "chat", ("answers.jsonl",), "answers")


def test_a_folder_the_job_writes_in_that_links_out_is_refused_naming_it(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "tasks").symlink_to(tmp_path / "outside")
    refuse_links(tmp_path / "job", ("bundle",))  # no such entry: nothing to refuse
    with pytest.raises(ParamError, match=rf"out_dir {tmp_path / 'job'}: tasks is a symbolic link \(to "
                                         rf"{tmp_path / 'outside'}\); a job writes and deletes only inside"):
        refuse_links(tmp_path / "job", ("bundle", "tasks"))
