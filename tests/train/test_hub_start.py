"""init_checkpoint: hub:ORG/NAME[@REVISION]: a run starts from a bundle cflib exported and pushed to a Hub on loopback
(tests/hub_server.py), at the commit its revision resolves to, which its record and its resume keep; a repository
that is no cflib/TR-MoE bundle, or a revision the Hub lacks, is refused by name before out_dir is written, and its
weights are never downloaded."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

huggingface_hub = pytest.importorskip("huggingface_hub")
import huggingface_hub.constants  # noqa: E402  (its lazy face lacks the submodule until something imports it)
from hub_server import LoopbackHub, point_at  # noqa: E402
from sft_shard_helpers import write_shard  # noqa: E402

from cflib.data.tasks import generate  # noqa: E402
from cflib.export import export_adapters, export_hub, push_folder  # noqa: E402
from cflib.export.peft import load_merged  # noqa: E402
from cflib.export.publish import resolve_adapters  # noqa: E402
from cflib.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from cflib.train import batch_arithmetic, prepare, train  # noqa: E402
from cflib.train.params import ParamError, TrainParams  # noqa: E402

REPO = "org/tiny"
# What a run downloads of a bundle: never its Python modules nor its card.
DOWNLOADED = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja"}
CHANGED_CARD = b"---\nlicense: mit\n---\n# a later commit\n"  # main moves on


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    train_examples, eval_examples = generate(seed=4)
    return write_shard(tmp_path_factory.mktemp("shard"), train_examples[:16], eval_examples[:4], max_seq_len=64)


def params(shard: Path, out_dir: Path, **overrides) -> dict:
    return {"data": str(shard), "out_dir": str(out_dir), "seq_len": 64, "micro_batch_per_rank": 4,
            "global_batch": 8, "max_steps": 2, "lr": 3e-3, "exact_match_limit": 0, "eval_at_start": False,
            "device": "cpu", **overrides}


@pytest.fixture(scope="module")
def bundle(shard, tmp_path_factory) -> Path:
    """A tiny model trained two steps, exported as a Hub bundle (its modules and card with it)."""
    root = tmp_path_factory.mktemp("bundle")
    train(params(shard, root / "run", model="smoke"), progress=False)
    return export_hub(root / "run", root / "bundle", echo=None)


@pytest.fixture
def hub(monkeypatch, tmp_path, bundle):
    """The loopback Hub holding the bundle in org/tiny, huggingface_hub pointed at it, its cache in tmp_path."""
    server = LoopbackHub()
    point_at(server, monkeypatch, tmp_path / "hf-home")
    push_folder(bundle, REPO, echo=None)
    try:
        yield server
    finally:
        server.stop()


def push_changed(hub: LoopbackHub, bundle: Path, folder: Path, repo: str = REPO, **changes: bytes | None) -> str:
    """The bundle with files replaced (None: removed) pushed to `repo`; the commit it makes."""
    shutil.copytree(bundle, folder)
    for name, content in changes.items():
        (folder / name).unlink(missing_ok=True)
        if content is not None:
            (folder / name).write_bytes(content)
    push_folder(folder, repo, echo=None)
    return hub.repos[repo].head("main")


def api_calls(hub: LoopbackHub) -> list[tuple[str, str]]:
    return [request for request in hub.requests if request[0] in ("GET", "HEAD")]


def test_a_run_starts_from_the_commit_its_revision_resolves_to_downloading_the_bundle_files_alone(
        hub, shard, bundle, tmp_path):
    head = hub.repos[REPO].head("main")
    figures = batch_arithmetic(TrainParams.from_dict(params(shard, tmp_path / "a", init_checkpoint=f"hub:{REPO}")))
    assert figures["model"] == f"checkpoint hub:{REPO}" and hub.downloads == [(REPO, "config.json")]

    record = train(params(shard, tmp_path / "a", init_checkpoint=f"hub:{REPO}"), progress=False)
    assert record["hub_start"] == {"repo_id": REPO, "revision": None, "commit": head}
    assert record["params"]["init_checkpoint"] == f"hub:{REPO}@{head}"  # what a later run names to train the same
    assert record["model_source"].startswith(f"checkpoint hub:{REPO}@{head} (")
    snapshot = Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--org--tiny" / "snapshots" / head
    assert str(snapshot) in record["model_source"]
    assert {name for _, name in hub.downloads} == DOWNLOADED & {p.name for p in bundle.iterdir()}
    assert any(p.suffix == ".py" for p in bundle.iterdir()) and not any(p.suffix == ".py" for p in snapshot.iterdir())
    card = huggingface_hub.ModelCard.load(export_hub(tmp_path / "a", tmp_path / "a-bundle", echo=None) / "README.md")
    meta = card.data.to_dict()["cflib"]  # the start by its repository and commit, never a path of this machine
    assert meta["base"] == {"source": f"Hub bundle {REPO} at commit {head}", "sha256": None}
    assert meta["training_parameters"]["init_checkpoint"] == f"hub:{REPO}@{head}"

    # Pinned, the commit is read from the cache: the same weights as the bundle's, nothing downloaded again.
    downloads = list(hub.downloads)
    run = prepare(TrainParams.from_dict(params(shard, tmp_path / "b", init_checkpoint=f"hub:{REPO}@{head}")))
    assert run.hub_start.commit == head and run.hub_start.revision == head and hub.downloads == downloads
    expected = load_checkpoint(bundle).state_dict()
    for name, tensor in run.model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_a_resume_keeps_the_commit_its_run_started_from(hub, shard, bundle, tmp_path):
    started = hub.repos[REPO].head("main")
    out_dir = tmp_path / "run"
    kept = {"max_steps": 4, "save_every_steps": 2, "lr_schedule": "wsd", "warmup_steps": 1,  # the schedule resumed
            "lr_decay_ratio": 0.5}
    train(params(shard, out_dir, init_checkpoint=f"hub:{REPO}", **kept), progress=False)
    (out_dir / "COMPLETE").unlink()  # as if killed after its last checkpoint
    shutil.copytree(out_dir, tmp_path / "copy")
    newer = push_changed(hub, bundle, tmp_path / "newer", **{"README.md": CHANGED_CARD})
    assert newer != started

    calls = len(api_calls(hub))
    record = train(params(shard, out_dir, init_checkpoint=f"hub:{REPO}", resume="latest", **kept), progress=False)
    assert record["hub_start"]["commit"] == started and record["params"]["init_checkpoint"] == f"hub:{REPO}@{started}"
    schedule = record["schedule"]
    assert (schedule["lr_schedule"], schedule["total_steps"], schedule["steps_done"], schedule["warmup_steps"],
            schedule["decay_steps"]) == ("wsd", 4, 4, 1, 2)
    assert record["model_source"].startswith("resumed from")
    assert len(api_calls(hub)) == calls  # the recorded commit: the Hub was not asked which main is now

    with pytest.raises(ParamError, match=f"model hub:{REPO}@{started}, this run has hub:{REPO}@{newer}: "
                                         "set allow_resume_changes: model"):
        train(params(shard, tmp_path / "copy", init_checkpoint=f"hub:{REPO}@{newer}", resume="latest", **kept),
              progress=False)


def bad_config(bundle: Path, **changes) -> bytes:
    config = {**json.loads((bundle / "config.json").read_text()), **changes}
    return json.dumps({key: value for key, value in config.items() if value is not None}).encode()


@pytest.mark.parametrize("change, words", [
    ({"config.json": None}, ["not a cflib/TR-MoE bundle", "has no config.json"]),
    ({"model.safetensors": None, "adapter_config.json": b"{}"}, ["has no model.safetensors", "LoRA adapters"]),
    ({"config.json": lambda b: bad_config(b, model_type="llama")}, ["names model_type 'llama', not 'tr_hash_moe'"]),
    ({"config.json": lambda b: bad_config(b, model_type=None)}, ["names no model_type"]),
    ({"config.json": lambda b: bad_config(b, auto_map={"AutoModelForCausalLM": "modeling_other.Other"})},
     ["maps classes of its own", "modeling_other.Other", "runs no code"]),
    ({"tokenizer_config.json": b'{"auto_map": {"AutoTokenizer": ["tok.Tok", null]}}'},
     ["tokenizer_config.json maps a tokenizer class of its own"]),
    # A config of a quarter of the width: the weights are more than such a model can take.
    ({"config.json": lambda b: bad_config(b, hidden_size=16)}, ["model.safetensors is", "the weights were not "
                                                                "downloaded"]),
], ids=["no-config", "adapters", "other-model-type", "no-model-type", "auto-map", "tokenizer-auto-map",
        "weights-past-the-config"])
def test_a_repository_that_is_no_cflib_bundle_is_refused_by_name_before_its_weights_are_downloaded(
        hub, shard, bundle, tmp_path, change, words):
    changes = {name: content(bundle) if callable(content) else content for name, content in change.items()}
    commit = push_changed(hub, bundle, tmp_path / "bad", "org/bad", **changes)
    with pytest.raises(CheckpointError) as refused:
        train(params(shard, tmp_path / "run", init_checkpoint="hub:org/bad"), progress=False)
    assert str(refused.value).startswith(f"hub:org/bad@{commit}: ")
    for word in words:
        assert word in str(refused.value), f"{word!r} not in: {refused.value}"
    assert (("org/bad", "model.safetensors") not in hub.downloads and not (tmp_path / "run").exists())


@pytest.mark.parametrize("spec, words", [
    (f"hub:{REPO}@nope", [f"hub:{REPO}@nope: {REPO} has no revision 'nope' on the Hugging Face Hub"]),
    (f"hub:{REPO}@{'0' * 40}", [f"has no revision '{'0' * 40}'"]),
    ("hub:org/none", ["no model repository org/none", "HF_TOKEN"]),
    ("hub:tiny", ["a Hub model is hub:ORG/NAME[@REVISION]"]),
    (f"hub:{REPO}@", ["a Hub model is hub:ORG/NAME[@REVISION]"]),
], ids=["revision", "commit", "repository", "no-org", "empty-revision"])
def test_a_revision_or_repository_the_hub_lacks_is_named(hub, shard, tmp_path, spec, words):
    with pytest.raises(CheckpointError) as refused:
        train(params(shard, tmp_path / "run", init_checkpoint=spec), progress=False)
    for word in words:
        assert word in str(refused.value), f"{word!r} not in: {refused.value}"
    assert hub.downloads == [] and not (tmp_path / "run").exists()


def corrupt_ids(shard: Path, folder: Path) -> Path:
    """A copy of the shard whose train input_ids hold a token id past the bundle's vocabulary."""
    import numpy as np

    shutil.copytree(shard, folder)
    ids = np.fromfile(folder / "train" / "input_ids.bin", dtype="<u4")
    ids[3] = 5000
    ids.tofile(folder / "train" / "input_ids.bin")
    return folder


@pytest.mark.parametrize("change, words", [
    (lambda shard, t: {"data": str(corrupt_ids(shard, t / "bad-shard"))}, ["input_ids.bin", "5000"]),
    (lambda shard, t: {"warmup_steps": 5}, ["warmup_steps 5 would warm up through the whole run of 2 steps"]),
    (lambda shard, t: {"global_batch": 32}, ["global_batch 32 is more than the 16 train examples"]),
], ids=["token-past-the-vocabulary", "warmup-past-the-run", "global-batch-past-the-data"])
def test_a_bad_shard_or_schedule_is_refused_before_the_weights_are_downloaded(hub, shard, tmp_path, change, words):
    """A Hub start reads the bundle's config.json alone before the data, the schedule and the batch are checked
    against it: a bad input is named before the weights are downloaded, and nothing is written."""
    with pytest.raises(ValueError) as refused:
        train(params(shard, tmp_path / "run", init_checkpoint=f"hub:{REPO}", **change(shard, tmp_path)),
              progress=False)
    for word in words:
        assert word in str(refused.value), f"{word!r} not in: {refused.value}"
    assert (REPO, "config.json") in hub.downloads and (REPO, "model.safetensors") not in hub.downloads
    assert not list(Path(huggingface_hub.constants.HF_HUB_CACHE).rglob("model.safetensors"))
    assert not (tmp_path / "run").exists()


def test_offline_a_commit_named_in_full_starts_from_the_cache_and_a_branch_is_refused_naming_it(
        hub, shard, tmp_path, monkeypatch):
    head = hub.repos[REPO].head("main")
    prepare(TrainParams.from_dict(params(shard, tmp_path / "a", init_checkpoint=f"hub:{REPO}")))  # fills the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calls = len(hub.requests)
    run = prepare(TrainParams.from_dict(params(shard, tmp_path / "b", init_checkpoint=f"hub:{REPO}@{head}")))
    assert run.hub_start.commit == head and len(hub.requests) == calls
    with pytest.raises(CheckpointError, match=f"hub:{REPO}: could not read it from the Hugging Face Hub .*needs "
                                              "network access, or, offline, a commit named in full that the Hugging "
                                              f"Face cache holds: hub:{REPO}@{head}$"):
        prepare(TrainParams.from_dict(params(shard, tmp_path / "c", init_checkpoint=f"hub:{REPO}")))


def test_a_lora_run_adapts_a_hub_base_and_resumes_on_it_after_the_cache_is_cleared(hub, shard, bundle, tmp_path):
    started = hub.repos[REPO].head("main")
    lora = {"init_checkpoint": f"hub:{REPO}", "full_parameter": False, "lora_rank": 4, "max_steps": 4,
            "save_every_steps": 2}
    out_dir = tmp_path / "run"
    record = train(params(shard, out_dir, **lora), progress=False)
    cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
    assert record["hub_start"]["commit"] == started
    assert record["lora"]["base"]["path"] == str(cache / "models--org--tiny" / "snapshots" / started)
    (out_dir / "COMPLETE").unlink()
    push_changed(hub, bundle, tmp_path / "newer", **{"README.md": CHANGED_CARD})
    shutil.rmtree(cache)  # the base is gone from this machine: downloaded again, at the commit the run started from
    resumed = train(params(shard, out_dir, **lora, resume="latest"), progress=False)
    assert resumed["hub_start"]["commit"] == started and resumed["lora"]["base"] == record["lora"]["base"]
    assert (cache / "models--org--tiny" / "snapshots" / started / "model.safetensors").is_file()


def test_adapters_trained_on_a_hub_base_name_it_at_their_commit_and_auto_peft_loads_that_base(
        hub, shard, bundle, tmp_path):
    """Exported adapters of a LoRA run from hub:ORG/NAME name the repository (base_model_name_or_path) and the
    commit they were trained on (revision), as does their card: AutoPeftModelForCausalLM downloads that commit of
    the base, with its model code, and gives cflib's adapted logits, however main moved since."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    started = hub.repos[REPO].head("main")
    out_dir = tmp_path / "run"
    train(params(shard, out_dir, init_checkpoint=f"hub:{REPO}", full_parameter=False, lora_rank=4, lr=3e-2),
          progress=False)
    halved = load_checkpoint(bundle)  # main moves on to other weights
    with torch.no_grad():
        for weight in halved.parameters():
            weight.mul_(0.5)
    push_folder(export_hub(save_checkpoint(halved, tmp_path / "halved"), tmp_path / "halved-bundle", echo=None),
                REPO, echo=None)
    assert hub.repos[REPO].head("main") != started

    checkpoint = resolve_adapters(out_dir)
    saved = json.loads((checkpoint / "adapter_config.json").read_text())
    assert (saved["base_model_name_or_path"], saved["revision"]) == (REPO, started)  # not the cache's folder
    folder = export_adapters(out_dir, tmp_path / "adapters", echo=None)
    exported = json.loads((folder / "adapter_config.json").read_text())
    assert exported == saved
    card = huggingface_hub.ModelCard.load(folder / "README.md")
    assert card.data.to_dict()["base_model"] == REPO
    assert card.data.to_dict()["cflib"]["base"]["source"] == f"Hub bundle {REPO} at commit {started}"
    assert f'from_pretrained("{REPO}", revision="{started}", trust_remote_code=True)' in card.text
    assert "AutoPeftModelForCausalLM" in card.text and str(tmp_path) not in card.text

    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    merged = load_merged(checkpoint).eval()
    ids = torch.tensor([[70, 5, 102, 9, 71, 33, 1, 40, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(ids) @ merged.head_weight.t(),
                                   rtol=0, atol=1e-4)
    # Another base named on purpose goes without the commit, which is that of the run's base.
    other = json.loads((export_adapters(out_dir, tmp_path / "other", echo=None, base_model="org/other")
                        / "adapter_config.json").read_text())
    assert (other["base_model_name_or_path"], other["revision"]) == ("org/other", None)


def test_a_resume_naming_the_run_s_branch_keeps_its_commit_offline_after_the_branch_moved(
        hub, shard, bundle, tmp_path, monkeypatch):
    """The checkpoint records the revision the run named: naming it again stands for the recorded commit, with no
    request to the Hub, so a full-parameter resume works offline however far main moved."""
    started = hub.repos[REPO].head("main")
    out_dir = tmp_path / "run"
    kept = {"init_checkpoint": f"hub:{REPO}@main", "max_steps": 4, "save_every_steps": 2}
    train(params(shard, out_dir, **kept), progress=False)
    (out_dir / "COMPLETE").unlink()
    push_changed(hub, bundle, tmp_path / "newer", **{"README.md": CHANGED_CARD})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calls = len(hub.requests)
    record = train(params(shard, out_dir, resume="latest", **kept), progress=False)
    assert len(hub.requests) == calls
    assert record["hub_start"] == {"repo_id": REPO, "revision": "main", "commit": started}
    assert record["params"]["init_checkpoint"] == f"hub:{REPO}@{started}"


def test_a_hub_teacher_is_pinned_to_its_commit_which_a_resume_naming_its_branch_keeps_offline(
        hub, shard, tmp_path, bundle, monkeypatch):
    """teacher_checkpoint: hub:ORG/NAME@main distils from the commit main names when the run starts: its parameters,
    plan and resume identity name that commit, and a resume naming main again keeps it, asking the Hub nothing."""
    started = hub.repos[REPO].head("main")
    out_dir = tmp_path / "run"
    kept = {"teacher_checkpoint": f"hub:{REPO}@main", "max_steps": 4, "save_every_steps": 2}
    record = train(params(shard, out_dir, **kept), progress=False)
    assert record["params"]["teacher_checkpoint"] == f"hub:{REPO}@{started}"
    assert record["execution_plan"]["distill"]["teacher"]["hub_start"] == {"repo_id": REPO, "revision": "main",
                                                                            "commit": started}
    (out_dir / "COMPLETE").unlink()
    push_changed(hub, bundle, tmp_path / "newer", **{"README.md": CHANGED_CARD})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calls = len(hub.requests)
    record = train(params(shard, out_dir, resume="latest", **kept), progress=False)
    assert len(hub.requests) == calls and record["params"]["teacher_checkpoint"] == f"hub:{REPO}@{started}"


def test_a_curriculum_pins_its_hub_start_once_for_every_stage(hub, shard, tmp_path):
    import yaml

    head = hub.repos[REPO].head("main")
    curriculum = tmp_path / "c.yaml"
    curriculum.write_text(yaml.safe_dump({"version": 1, "compare_one_stage": True, "stages": [
        {"name": "one", "max_steps": 1}, {"name": "two", "max_steps": 1}]}))
    out_dir = tmp_path / "run"
    record = train(params(shard, out_dir, init_checkpoint=f"hub:{REPO}@main", curriculum=str(curriculum),
                          max_steps=None), progress=False)
    resolved = [path for method, path in hub.requests if path.endswith("/revision/main")]
    assert len(resolved) == 1, hub.requests
    assert record["curriculum"]["stages"][0]["started_from"] == f"hub:{REPO}@{head}"
    one_stage = json.loads((out_dir / "one_stage" / "record.json").read_text())
    assert one_stage["hub_start"]["commit"] == head
    assert json.loads((out_dir / "curriculum.json").read_text())["hub_start"]["commit"] == head


class InProcessPoint:
    """A sweep point's papermill process, run in this one: the run train_sft.ipynb starts from the point's point.yaml
    (the parameters papermill hands it), then its executed notebook, marked as run to its last cell."""

    def __init__(self, command: list[str], **_) -> None:
        import nbformat

        from cflib.train.params import load_params_file

        parameters = command.index("-f") + 1
        train(load_params_file(Path(command[parameters])), progress=False)
        notebook = nbformat.v4.new_notebook()
        notebook.metadata["papermill"] = {"end_time": "2026-01-01T00:00:00", "exception": None}
        nbformat.write(notebook, command[parameters - 2])
        self.pid, self.returncode = -1, 0

    def poll(self) -> int:
        return self.returncode


def sweep_base(shard: Path, folder: Path, **overrides) -> str:
    import yaml

    values = {**params(shard, folder, **overrides)}
    del values["out_dir"]  # the sweep's
    (folder / "base.yaml").write_text(yaml.safe_dump(values))
    return str(folder / "base.yaml")


def test_a_sweep_pins_its_hub_start_once_so_a_commit_between_its_points_moves_none(
        hub, shard, bundle, tmp_path, monkeypatch):
    """hub:ORG/NAME@main is resolved once as the sweep is planned: main moving between the first point and the
    second moves neither, sweep.json records the commit, and the sweep run again (a point added) keeps it."""
    import subprocess
    from types import SimpleNamespace

    from cflib.lab import sweep_run
    from cflib.lab.sweep import SweepParams, expand_sweep

    started = hub.repos[REPO].head("main")
    raw = {"base": sweep_base(shard, tmp_path, init_checkpoint=f"hub:{REPO}@main"), "grid": {"lr": [1e-3, 2e-3]},
           "out_dir": str(tmp_path / "sweep")}
    monkeypatch.setattr(sweep_run, "subprocess", SimpleNamespace(
        Popen=InProcessPoint, PIPE=subprocess.PIPE, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired))
    finish, moved = sweep_run._finish, []

    def finish_then_move_main(running, sweep) -> None:
        finish(running, sweep)
        if not moved:  # main moves on between the points
            moved.append(push_changed(hub, bundle, tmp_path / "newer", **{"README.md": CHANGED_CARD}))

    monkeypatch.setattr(sweep_run, "_finish", finish_then_move_main)
    sweep = sweep_run.run_sweep(expand_sweep(SweepParams.from_dict(raw)), poll_s=0.01)
    assert [point.status for point in sweep.points] == ["done", "done"] and moved and moved[0] != started
    for point in sweep.points:
        record = json.loads((point.run_dir / "record.json").read_text())
        assert record["hub_start"]["commit"] == started, point.name
        assert record["params"]["init_checkpoint"] == f"hub:{REPO}@{started}"
    assert [path for _, path in hub.requests if path.endswith("/revision/main")] == [f"/api/models/{REPO}/revision/main"]
    pinned = {f"hub:{REPO}@main": {"repo_id": REPO, "revision": "main", "commit": started}}
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["hub_starts"] == pinned

    calls = len(hub.requests)
    again = expand_sweep(SweepParams.from_dict({**raw, "grid": {"lr": [1e-3, 2e-3, 3e-3]}}))
    assert [point.action for point in again.points][:2] == ["skip: finished before"] * 2
    assert again.points[2].params["init_checkpoint"] == f"hub:{REPO}@{started}" and again.hub_starts == pinned
    assert not [path for _, path in hub.requests[calls:] if path.endswith("/revision/main")]
    assert f"hub      hub:{REPO}@main pinned to commit {started}" in again.describe()


def test_a_sweep_file_s_hub_starts_are_checked_and_one_written_before_them_pins_nothing(hub, shard, tmp_path):
    from cflib.lab.sweep import SweepParams, expand_sweep

    raw = {"base": sweep_base(shard, tmp_path, init_checkpoint=f"hub:{REPO}"), "grid": {"lr": [1e-3]},
           "out_dir": str(tmp_path / "sweep")}
    sweep = expand_sweep(SweepParams.from_dict(raw))
    assert sweep.points[0].params["init_checkpoint"] == f"hub:{REPO}@{hub.repos[REPO].head('main')}"
    sweep.save()
    sweep_file = tmp_path / "sweep" / "sweep.json"
    written = json.loads(sweep_file.read_text())
    sweep_file.write_text(json.dumps({**written, "hub_starts": {f"hub:{REPO}": {"repo_id": REPO, "commit": "main"}}}))
    with pytest.raises(ParamError, match=rf"hub_starts\['hub:{REPO}'\] must name the repository {REPO} and a commit "
                                         "in full"):
        expand_sweep(SweepParams.from_dict(raw))
    sweep_file.write_text(json.dumps({key: value for key, value in written.items() if key != "hub_starts"}))
    legacy = expand_sweep(SweepParams.from_dict(raw))  # its points resolve their own, as they did
    assert legacy.points[0].params["init_checkpoint"] == f"hub:{REPO}" and legacy.hub_starts is None
    legacy.save()
    assert "hub_starts" not in json.loads(sweep_file.read_text())
