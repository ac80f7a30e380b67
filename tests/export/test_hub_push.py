"""Publishing: the model card (parsed by huggingface_hub's ModelCard), and pushes through huggingface_hub to a Hub on
loopback (tests/hub_server.py) that records every file it receives, compared byte for byte with what was written."""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import torch

huggingface_hub = pytest.importorskip("huggingface_hub")
import huggingface_hub.constants  # noqa: E402  (its lazy face lacks the submodule until something imports it)
from hub_server import LoopbackHub, point_at  # noqa: E402
from sft_shard_helpers import write_shard  # noqa: E402

from cflib.data.tasks import generate  # noqa: E402
from cflib.export import PushError, export_hub, push_folder  # noqa: E402
from cflib.export.__main__ import main as export_main  # noqa: E402
from cflib.export.model_card import evaluation  # noqa: E402
from cflib.export.peft import merge  # noqa: E402
from cflib.model import TRMoEModel, preset, save_checkpoint  # noqa: E402
from cflib.train import train  # noqa: E402
from cflib.train.params import ParamError, TrainParams  # noqa: E402

FAST = {"model": "smoke", "max_steps": 2, "eval_every_steps": None, "exact_match_limit": 8, "device": "cpu"}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The loopback Hub, and huggingface_hub pointed at it with a token (hub_server.point_at)."""
    server = LoopbackHub()
    point_at(server, monkeypatch, tmp_path / "hf-home")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished full-parameter run on the embedded tasks."""
    out_dir = tmp_path_factory.mktemp("push") / "run"
    train({**FAST, "out_dir": str(out_dir), "eval_every_steps": 1}, progress=False)
    return out_dir


def refused(arguments: list[str]) -> str:
    """The one line `python -m cflib.export ARGUMENTS` ends with (its SystemExit message, exit status 1)."""
    with pytest.raises(SystemExit) as stopped:
        export_main(arguments)
    return str(stopped.value.code)


def written(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_model_card_names_the_checkpoint_its_data_evaluation_kernels_and_throughput(run, tmp_path, monkeypatch):
    record = json.loads((run / "record.json").read_text())
    bundle = export_hub(run, tmp_path / "bundle", echo=None)
    card = huggingface_hub.ModelCard.load(bundle / "README.md")
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert "cflib" in meta["tags"] and "license" not in meta  # the licence is the user's to set
    assert re.search(r"^# license: ", (bundle / "README.md").read_text(), re.M)
    cflib = meta["cflib"]
    best = run / "checkpoints" / "best"
    assert cflib["checkpoint"] == {"name": "best", "run": "run", "sha256": sha256(best / "model.safetensors")}
    assert cflib["base"] == {"source": "preset smoke (trained from scratch)", "sha256": None}
    for partition in ("train", "eval"):
        index = json.loads((Path(record["data"]["root"]) / partition / "sft.idx.json").read_text())
        assert cflib["data"][partition] == {"examples": index["examples"], "sha256": index["sha256"]}
    evaluated = next(e for e in reversed(record["eval"]["history"]) if e["step"] == int(record["checkpoints"]["best_step"]))
    assert cflib["evaluation"]["eval/loss"] == pytest.approx(evaluated["loss"])
    assert cflib["evaluation"]["eval/exact_match/overall"] == evaluated["exact_match"]["overall"]
    assert cflib["training_parameters"] == {**record["params"], "out_dir": "run", "data": "embedded"}
    assert cflib["kernel_path"] == record["kernel_path"]
    for folder in (run.parent, tmp_path):  # no path of this machine goes public
        assert str(folder) not in (bundle / "README.md").read_text()
    assert cflib["repo_id"] is None and card.text.startswith("\n# bundle\n")
    assert cflib["throughput"]["steady_state_tokens_per_s"] == record["throughput"]["steady_state_tokens_per_s"]
    assert f"| `eval/loss` | {evaluated['loss']:.4g} |" in card.text
    # The card's loading lines run as written, on the folder they name (by its name: run beside it).
    code = re.search(r"## How to load it\n\n```python\n(.*?)```", card.text, re.S).group(1)
    assert 'from_pretrained("bundle", trust_remote_code=True)' in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})


def test_the_evaluation_table_takes_every_metric_the_run_holds(tmp_path):
    """Metrics the record may come to hold (a task's exact match, lm-eval results) appear under their own names."""
    final = {"tag": "epoch-1", "step": 4, "loss": 0.5, "exact_match": {"addition": 0.25, "overall": 0.25},
             "pass_rate": {"regex": 0.75}, "exact_match_samples": [{"hit": True}], "seconds": 1.0}
    record = {"eval": {"history": [final], "final": final}, "checkpoints": {"best_step": "4"},
              "lm_eval": [{"task": "arc_easy", "metric": "acc", "filter": "none", "value": 0.5}]}
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "record.json").write_text(json.dumps({"scores": [
        {"task": "embedded_exact", "metric": "exact_match", "filter": "strict", "value": 1.0, "stderr": 0.0}]}))
    assert evaluation(record, tmp_path, "best") == {
        "eval/loss": 0.5, "eval/exact_match/addition": 0.25, "eval/exact_match/overall": 0.25,
        "eval/pass_rate/regex": 0.75, "lm_eval/arc_easy/acc": 0.5, "lm_eval/embedded_exact/exact_match,strict": 1.0}
    assert evaluation(record, tmp_path, "epoch-1")["eval/loss"] == 0.5
    assert "lm_eval/embedded_exact/exact_match,strict" not in evaluation(record, tmp_path, "epoch-1")


def test_push_sends_the_bundle_byte_for_byte(run, tmp_path, hub, capsys):
    out = tmp_path / "bundle"
    export_main(["hub", str(run), str(out), "--push", "cflib-org/tiny", "--private"])
    assert hub.files("cflib-org/tiny") == written(out)
    assert hub.repos["cflib-org/tiny"].private is True
    assert ("POST", "/api/validate-yaml") in hub.requests  # the card's metadata checked before any upload
    weights = sha256(out / "model.safetensors")
    assert hub.lfs_uploads == {weights: 1}  # through the LFS API; every other file in the commit itself
    assert 'from_pretrained("cflib-org/tiny", trust_remote_code=True)' in (out / "README.md").read_text()
    assert "pushed" in capsys.readouterr().out


def test_an_interrupted_push_resumes_without_sending_again_what_landed(run, tmp_path, hub, capsys):
    out, command = tmp_path / "bundle", ["hub", str(run), str(tmp_path / "bundle"), "--push", "cflib-org/resumed"]
    hub.fail_commits = 1  # the weights land, then the commit fails
    assert "the same push again sends only the rest" in refused(command)
    assert hub.files("cflib-org/resumed") == {} and sum(hub.lfs_uploads.values()) == 1
    export_main(command)  # the same command again: the written bundle, pushed as it is
    assert "already holds the bundle" in capsys.readouterr().out
    assert hub.files("cflib-org/resumed") == written(out)
    assert hub.lfs_uploads == {sha256(out / "model.safetensors"): 1}  # not sent twice
    export_main(command)  # nothing left to send: no empty commit
    assert len(hub.repos["cflib-org/resumed"].commits) == 1


def test_a_folder_holding_more_than_the_bundle_or_other_bytes_is_never_pushed(run, tmp_path, hub):
    """A push sends the whole folder: a file put beside the bundle (a secret, say) or weights changed since it was
    written would be published. Both are refused, naming the file, and nothing is sent."""
    out = export_hub(run, tmp_path / "hub", echo=None)
    command = ["hub", str(run), str(out), "--push", "cflib-org/guarded"]
    (out / ".env").write_text("HF_TOKEN=hf_secret\n")
    assert f"{out / '.env'}: the bundle export does not write it" in refused(command)
    (out / ".env").unlink()
    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[:-4] + b"\0\0\0\0")
    assert f"{out / 'model.safetensors'}: differs from what the bundle export writes" in refused(command)
    assert "cflib-org/guarded" not in hub.repos
    (out / "model.safetensors").write_bytes(weights)
    export_main(command)  # as written: pushed
    assert hub.files("cflib-org/guarded") == written(out)
    assert not [entry for entry in tmp_path.iterdir() if entry.name.startswith(".")]  # no scratch left beside


def test_a_folder_written_for_no_repository_is_pushed_with_its_card_naming_the_repository(run, tmp_path, hub, capsys):
    """The resume command after train_sft wrote out_dir/hub itself: the bundle goes as it is, but its card, whose
    loading lines named the folder, is written again for the repository first."""
    out = export_hub(run, tmp_path / "hub", echo=None)
    assert 'from_pretrained("hub", trust_remote_code=True)' in (out / "README.md").read_text()
    weights = (out / "model.safetensors").read_bytes()
    export_main(["hub", str(run), str(out), "--push", "cflib-org/later"])
    assert "already holds the bundle" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert 'from_pretrained("cflib-org/later", trust_remote_code=True)' in card and "\n# later\n" in card
    assert huggingface_hub.ModelCard.load(out / "README.md").data.to_dict()["cflib"]["repo_id"] == "cflib-org/later"
    assert (out / "model.safetensors").read_bytes() == weights  # the bundle itself untouched
    assert hub.files("cflib-org/later") == written(out)
    export_main(["hub", str(run), str(out), "--push", "cflib-org/later"])  # the card already names it: unchanged
    assert (out / "README.md").read_text() == card and len(hub.repos["cflib-org/later"].commits) == 1


def test_push_to_a_branch_creates_it_from_main(run, tmp_path, hub):
    out = tmp_path / "bundle"
    export_main(["hub", str(run), str(out), "--push", "cflib-org/branched", "--revision", "candidate"])
    assert hub.files("cflib-org/branched", "candidate") == written(out)
    assert hub.files("cflib-org/branched", "main") == {}
    assert hub.repos["cflib-org/branched"].private is None  # public unless asked, or the owner's default


def test_push_to_hub_at_the_end_of_a_run_sends_its_bundle(tmp_path, hub):
    out_dir = tmp_path / "run"
    train({**FAST, "out_dir": str(out_dir), "push_to_hub": "cflib-org/run-end"}, progress=False)
    assert hub.files("cflib-org/run-end") == written(out_dir / "hub")
    assert hub.repos["cflib-org/run-end"].private is True  # a run's end publishes nothing by itself
    card = huggingface_hub.ModelCard.load(out_dir / "hub" / "README.md")
    assert card.data.to_dict()["cflib"]["checkpoint"]["sha256"] == sha256(out_dir / "checkpoints/best/model.safetensors")


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    train_examples, eval_examples = generate(seed=1)
    return write_shard(tmp_path_factory.mktemp("shard"), train_examples[:32], eval_examples[:8], max_seq_len=64)


def test_a_lora_run_pushes_its_adapters_with_their_card(tmp_path, hub, shard):
    torch.manual_seed(3)
    base = save_checkpoint(TRMoEModel(preset("smoke")), tmp_path / "base")
    out_dir = tmp_path / "lora"
    train({**FAST, "data": str(shard), "init_checkpoint": str(base), "out_dir": str(out_dir), "full_parameter": False,
           "lora_rank": 4, "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 16,
           "push_to_hub": "cflib-org/adapters"}, progress=False)
    folder = out_dir / "adapters"
    assert sorted(written(folder)) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                       "cflib_adapter.json"]
    assert hub.files("cflib-org/adapters") == written(folder)
    best = out_dir / "checkpoints" / "best"
    assert (folder / "adapter_model.safetensors").read_bytes() == (best / "adapter_model.safetensors").read_bytes()
    saved, published = (json.loads((where / "adapter_config.json").read_text()) for where in (best, folder))
    # No base named: a folder name of this machine would send AutoPeftModel to the Hub for a repository of that name.
    assert published == {**saved, "base_model_name_or_path": None}
    assert str(tmp_path) not in "".join(content.decode() for name, content in written(folder).items()
                                        if not name.endswith(".safetensors"))
    meta = huggingface_hub.ModelCard.load(folder / "README.md").data.to_dict()
    assert meta["library_name"] == "peft" and "lora" in meta["tags"]
    assert meta["cflib"]["base"] == {"source": "checkpoint base", "sha256": sha256(base / "model.safetensors")}
    assert math.isfinite(meta["cflib"]["evaluation"]["eval/loss"])
    # Merged into their base (as train_sft's last cells do), the bundle's card still tells the run that trained them.
    merge(best, out_dir / "merged")
    card = (export_hub(out_dir / "merged", tmp_path / "bundle", echo=None) / "README.md").read_text()
    merged = huggingface_hub.ModelCard.load(tmp_path / "bundle" / "README.md").data.to_dict()["cflib"]
    assert merged["checkpoint"] == {"name": "best", "run": "lora", "merged_adapters": True,
                                    "sha256": sha256(out_dir / "merged" / "model.safetensors")}
    assert merged["evaluation"] == meta["cflib"]["evaluation"] and merged["base"] == meta["cflib"]["base"]
    assert "`best` of the run lora, its LoRA adapters merged into their base" in card


def test_bad_pushes_are_refused_naming_the_culprit(run, tmp_path, hub, monkeypatch, capsys):
    assert "--push: 'no-owner' is not a Hub repository name" in refused(["hub", str(run), str(tmp_path / "a"),
                                                                         "--push", "no-owner"])
    assert not (tmp_path / "a").exists()  # refused before anything was written
    for command, options in (("hub", ["--private"]), ("adapters", ["--revision", "candidate"])):
        with pytest.raises(SystemExit) as stopped:  # a push's options without --push: nothing would use them
            export_main([command, str(run), str(tmp_path / "a"), *options])
        assert stopped.value.code == 2 and f"{options[0]} needs --push ORG/NAME" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    with pytest.raises(ParamError, match="push_to_hub: 'a/b/c' is not a Hub repository name"):
        TrainParams.from_dict({"push_to_hub": "a/b/c"})
    with pytest.raises(ParamError, match="'push_to_hub' is the run's"):
        (tmp_path / "curriculum.yaml").write_text("version: 1\nstages:\n- {name: one, push_to_hub: a/b}\n")
        train({**FAST, "curriculum": str(tmp_path / "curriculum.yaml"), "out_dir": str(tmp_path / "c")}, progress=False)
    assert "neither LoRA adapters (adapter_config.json) nor a LoRA run folder" in refused(
        ["adapters", str(run), str(tmp_path / "b")])
    monkeypatch.delenv("HF_TOKEN")
    assert "pushing to cflib-org/x needs a Hugging Face token: run `hf auth login`" in refused(
        ["hub", str(run), str(tmp_path / "c"), "--push", "cflib-org/x"])
    with pytest.raises(PushError, match="needs a Hugging Face token"):
        push_folder(run, "cflib-org/x")
    with pytest.raises(PushError, match="needs a Hugging Face token"):  # before the run's first step
        train({**FAST, "out_dir": str(tmp_path / "d"), "push_to_hub": "cflib-org/x"}, progress=False)
    assert not (tmp_path / "d").exists()
    assert hub.requests == [] and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_a_symbolic_link_in_the_folder_is_refused_before_anything_is_sent(tmp_path, hub):
    """upload_folder would send the link's target, a file outside the folder, under the link's name."""
    (tmp_path / "secret.txt").write_text("not for the Hub\n")
    folder = tmp_path / "bundle"
    (folder / "nested" / "deeper").mkdir(parents=True)
    (folder / "config.json").write_text("{}\n")
    (folder / "nested" / "deeper" / "notes.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(PushError, match=r"nested/deeper/notes.txt: a symbolic link \(to .*secret.txt\)"):
        push_folder(folder, "cflib-org/links", echo=None)
    assert hub.requests == []  # not even the repository's creation
