"""`python -m cflib.bench ...` and `cflib.bench.decode` (on a machine without a GPU) given bad arguments or files:
each ends in one line naming the culprit and a non-zero status, never a traceback."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from cflib.jsonio import MAX_BYTES, MAX_DEPTH

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "outputs" / "records" / "throughput_200m_h200.json"


def cli(*arguments: str) -> subprocess.CompletedProcess:
    """The entry point run with no GPU visible, as on a machine without one."""
    return subprocess.run([sys.executable, "-m", *arguments], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("entry_points")
    (root / "list.json").write_text("[1, 2]\n")
    (root / "afile").write_text("a file, not a folder")
    (root / "broken.json").write_text('{"kind": "throughput", ')
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)  # json.loads alone recurses out of the stack
    with open(root / "huge.json", "wb") as huge:  # one byte past the bound, sparse: nothing written but the size
        huge.truncate(MAX_BYTES + 1)
    return root


CASES = [
    ("table-of-a-list", lambda w: ["cflib.bench", "perf-table", str(w / "list.json")],
     ["list.json", "a record is a JSON object"]),
    ("table-of-a-missing-record", lambda w: ["cflib.bench", "headline-table", str(w / "nowhere.json")],
     ["nowhere.json", "no such throughput record"]),
    ("table-of-malformed-json", lambda w: ["cflib.bench", "perf-table", str(w / "broken.json")],
     ["broken.json", "not valid JSON"]),
    ("table-of-too-deep-json", lambda w: ["cflib.bench", "perf-table", str(w / "deep.json")],
     ["deep.json", f"JSON nested deeper than {MAX_DEPTH} levels"]),
    ("table-of-an-oversize-record", lambda w: ["cflib.bench", "headline-table", str(w / "huge.json")],
     ["huge.json", f"larger than the {MAX_BYTES:,} bytes cflib reads in a throughput record"]),
    ("table-into-a-missing-page", lambda w: ["cflib.bench", "perf-table", str(RECORD), "--into", str(w / "no.md")],
     ["no.md", "no such Markdown page"]),
    ("decode-on-no-such-device", lambda w: ["cflib.bench.decode", "--out", str(w / "d"), "--device", "tpu"],
     ["--device", "invalid choice: 'tpu'"]),
    ("decode-under-a-file", lambda w: ["cflib.bench.decode", "--out", str(w / "afile" / "x"), "--smoke"],
     ["afile/x", "Not a directory"]),
]


def run_in_process(module: str, arguments: list[str], capsys) -> tuple[int, str]:
    """The module run as `python -m` runs it, in this process: its exit status and what it wrote to stderr. Any
    exception but SystemExit propagates, failing the test as a traceback would."""
    argv = sys.argv
    sys.argv = [module, *arguments]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as stop:  # as the interpreter ends: None is 0, a message goes to stderr with status 1
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            status = 1
            print(stop.code, file=sys.stderr)
    finally:
        sys.argv = argv
    return status, capsys.readouterr().err


@pytest.mark.parametrize("arguments, words", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_ends_in_one_line_naming_the_culprit(world, arguments, words, capsys):
    module, *rest = arguments(world)
    status, stderr = run_in_process(module, rest, capsys)
    assert status != 0 and "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last, last


@pytest.mark.slow
@pytest.mark.parametrize("case", ["table-of-too-deep-json", "decode-under-a-file"])
def test_each_entry_point_as_its_own_process_ends_in_one_line(world, case):
    """The same, through `python -m` in a process of its own, once per entry point: what the process prints as it
    starts and ends is the user's too."""
    arguments, words = next(c[1:] for c in CASES if c[0] == case)
    done = cli(*arguments(world))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last, last


def test_a_page_rewritten_on_a_full_disk_is_left_whole(tmp_path, monkeypatch, capsys):
    try:
        from small_disk import fill, small_disk
    except ImportError:  # run from the repository root as a package
        from tests.small_disk import fill, small_disk
    with small_disk(tmp_path / "disk", "1m") as disk:
        page = (disk or tmp_path) / "page.md"
        page.write_text(f"intro\n<!-- perf-table {RECORD} -->\nold\n<!-- /perf-table -->\n" + "outro\n" * 500)
        if disk is None:  # no tmpfs here: the write fails part-way as a full disk makes it fail
            def full(path, text, *args, **kwargs):
                with open(path, "w") as out:
                    out.write(text[:100])
                raise OSError(28, "No space left on device")
            monkeypatch.setattr(Path, "write_text", full)
        else:
            fill(disk)
        before = page.read_bytes()
        status, stderr = run_in_process("cflib.bench", ["perf-table", str(RECORD), "--into", str(page)], capsys)
        assert status != 0 and "No space left on device" in stderr.strip().splitlines()[-1], stderr
        assert page.read_bytes() == before
        assert sorted(p.name for p in page.parent.iterdir()) == (["ballast", "page.md"] if disk else ["page.md"])
