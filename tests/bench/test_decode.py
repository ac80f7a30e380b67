"""cflib.bench.decode at smoke size on the CPU: every path measured or its error recorded, the record complete."""
from __future__ import annotations

import json

from cflib.bench.decode import SMOKE, main


def test_smoke_run_writes_a_complete_record(tmp_path, capsys):
    main(["--out", str(tmp_path), "--smoke"])
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["settings"] == {**record["settings"], "model": "smoke", "prompts": SMOKE.prompts}
    assert record["framework"]["torch"] and record["device"]["type"] == "cpu"
    new_tokens = SMOKE.prompts * SMOKE.new_tokens
    for name in ("decoder", "decoder_kernels", "no_cache", "hf_bundle", "hf_bundle_static", "hf_llama",
                 "hf_llama_static"):
        assert record[name]["new_tokens"] == new_tokens and record[name]["tokens_per_s"] > 0, record[name]
    for side in ("hf_bundle", "hf_llama"):
        assert record[side]["cache"] == "dynamic" and record[f"{side}_static"]["cache"] == "static"
        assert record[f"{side}_static"]["compiled_decode_step"] is False  # generate() compiles on a GPU only
    assert set(record["targets"]) == {"dynamic", "static_compiled"}
    for cache, target in record["targets"].items():
        side = "" if cache == "dynamic" else "_static"
        assert target["bundle_vs_llama"] == record["tokens_per_s"][f"hf_bundle{side}"] / record["tokens_per_s"][
            f"hf_llama{side}"]
    assert record["decoder"]["decoder"]["kernel_path"]["attention"] == "sdpa_kv_cache"
    assert not record["decoder"]["decoder"]["cuda_graph"]  # the CPU decodes eagerly
    # fp32 on the CPU: the cache changes nothing but speed, and transformers' generate() on the exported
    # bundle of the same weights chooses the same tokens
    assert record["no_cache"]["agreement_with_decoder"]["identical_rows"] == SMOKE.prompts
    assert record["hf_bundle"]["agreement_with_decoder"]["identical_rows"] == SMOKE.prompts
    assert record["hf_bundle_static"]["agreement_with_decoder"]["identical_rows"] == SMOKE.prompts
    passed = record["exact_match_pass"]
    assert passed["examples"] == SMOKE.exact_match_examples and passed["seconds"] > 0
    assert passed["decoder"]["kernel_path"]["attention"] == "sdpa_kv_cache"
    assert passed["new_tokens"] == passed["data"]["answer_tokens"]["total"]
    assert passed["data"]["prompt_tokens"]["max"] < passed["data"]["length"]["cap"]
    assert not any("tokens" in part for part in record.values() if isinstance(part, dict))
    assert [entry.name for entry in tmp_path.iterdir()] == ["record.json"]  # its scratch bundles gone
    printed = capsys.readouterr().out
    assert "new tokens/s" in printed and "bundle / llama, static_compiled cache:" in printed
