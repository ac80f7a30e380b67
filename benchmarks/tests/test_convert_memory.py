"""benchmarks/convert_memory.py at small sizes: each size converted in a process of its own, the synthetic rows'
planted rejections counted, the peaks read and written to the record (the figures themselves are the record's)."""
from __future__ import annotations

import json

import convert_memory


def test_each_size_is_converted_and_its_peak_recorded(tmp_path):
    record_path = tmp_path / "records" / "convert_memory.json"
    record = convert_memory.main(["--rows", "200", "2000", "--record", str(record_path)])
    assert json.loads(record_path.read_text()) == record and record["job"] == "convert_memory"
    small, large = record["results"]
    assert (small["rows"], large["rows"]) == (200, 2000)
    # every thousand rows holds one duplicate, one empty answer and one over-long conversation
    assert small["rejected"] == {"too_long": 1, "duplicate": 1, "duplicate_of_train": 0, "empty_answer": 1}
    assert large["rejected"] == {"too_long": 2, "duplicate": 2, "duplicate_of_train": 0, "empty_answer": 2}
    assert (small["train"]["examples"], large["train"]["examples"]) == (197, 1994)
    for result in (small, large):
        assert 0 < result["peak_rss_after_imports_kib"] <= result["peak_rss_kib"]
        assert 0 < result["train"]["supervised_tokens"] < result["train"]["num_tokens"]
