"""The Hub bundle of a model trained by cflib.train: loaded by transformers, it computes what cflib computes."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers  # the test extra: the bundle is for it; cflib never imports it
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sft_shard_helpers import write_shard

from cflib.data import ByteTokenizer
from cflib.data.tasks import generate as task_examples
from cflib.export import ExportError, TokenizerExportError, export_hub
from cflib.export.__main__ import main as export_main
from cflib.model import CheckpointError, ModelConfig, TRMoEModel, load_checkpoint, preset, save_checkpoint
from cflib.train import train


try:
    from cflib.model.generate import generate as cflib_generate  # the cached decoder, where it exists
except ImportError:
    cflib_generate = None

BUNDLE_FILES = ["README.md", "config.json", "configuration_tr_hash_moe.py", "generation_config.json",
                "model.safetensors", "modeling_tr_hash_moe.py", "special_tokens_map.json", "tokenizer.json",
                "tokenizer_config.json"]
DERIVED = ("self_attn.rotary_emb.inv_freq", "mlp.engine.fused_route_codes", "mlp.engine.fused_expert_pairs")
TOKENIZER = ByteTokenizer()


def smoke_config(**overrides: object) -> ModelConfig:
    return ModelConfig(**{**preset("smoke").to_dict(), **overrides})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A few optimizer steps of the smoke model on the embedded tasks, through the real training loop."""
    train_examples, eval_examples = task_examples(seed=1)
    shard = write_shard(tmp_path_factory.mktemp("shard"), train_examples[:32], eval_examples[:8], max_seq_len=64)
    out = tmp_path_factory.mktemp("runs") / "run"
    train({"model": "smoke", "data": str(shard), "out_dir": str(out), "seq_len": 64, "micro_batch_per_rank": 16,
           "global_batch": 16, "lr": 1e-2, "max_steps": 3, "eval_at_start": False, "exact_match_limit": 0,
           "device": "cpu"}, progress=False)
    return out


@pytest.fixture(scope="module")
def bundle(run_dir: Path, tmp_path_factory) -> tuple[Path, list[str]]:
    lines: list[str] = []
    out = export_hub(run_dir, tmp_path_factory.mktemp("export") / "bundle", echo=lines.append)
    return out, lines


@pytest.fixture(scope="module")
def reference(run_dir: Path) -> TRMoEModel:
    return load_checkpoint(run_dir / "checkpoints" / "best").eval()


def from_pretrained(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True,
                                                                    output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def hub_model(bundle: tuple[Path, list[str]]):
    return from_pretrained(bundle[0])


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> tuple[TRMoEModel, object]:
    """A smoke model with its matrices scaled up tenfold: its greedy continuation changes token at almost
    every step (a trained tiny model soon repeats itself), so a wrong cache or position shows."""
    torch.manual_seed(0)
    model = TRMoEModel(smoke_config()).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(10.0)
    root = tmp_path_factory.mktemp("varied")
    out = export_hub(save_checkpoint(model, root / "ckpt"), root / "bundle", echo=None)
    return model, from_pretrained(out)[0]


def test_every_checkpoint_of_the_run_carries_the_derived_buffers(run_dir: Path):
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["best", "epoch-1", "last"]  # each saved by the trainer
    for checkpoint in checkpoints:
        with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
        assert {f"layers.{i}.{suffix}" for i in range(2) for suffix in DERIVED} <= names, checkpoint


def test_a_run_folder_exports_its_best_checkpoint(bundle: tuple[Path, list[str]], run_dir: Path):
    out, lines = bundle
    assert lines[0] == f"exported {run_dir / 'checkpoints' / 'best'}: the run's best evaluation loss"
    assert sorted(p.name for p in out.iterdir()) == BUNDLE_FILES


def test_config_and_weights_are_the_published_layout(bundle: tuple[Path, list[str]], reference: TRMoEModel,
                                                     run_dir: Path):
    out, _ = bundle
    config = json.loads((out / "config.json").read_text())
    hub_keys = {"model_type": "tr_hash_moe", "architectures": ["TRHashForCausalLM"],
                "auto_map": {"AutoConfig": "configuration_tr_hash_moe.TRHashConfig",
                             "AutoModelForCausalLM": "modeling_tr_hash_moe.TRHashForCausalLM"},
                "is_decoder": True, "is_encoder_decoder": False, "use_cache": True, "attention_dropout": 0.0,
                "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0, "unk_token_id": None}
    assert config == {**reference.config.to_dict(), **hub_keys}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        exported = {name: f.get_tensor(name) for name in f.keys()}
    source = load_file(str(run_dir / "checkpoints" / "best" / "model.safetensors"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the bundle is a cflib checkpoint too: every Hub key is known
        assert load_checkpoint(out).config == reference.config


def test_loads_with_no_missing_or_unexpected_keys(hub_model, reference: TRMoEModel):
    model, info = hub_model
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert type(model).__name__ == "TRHashForCausalLM"
    assert model.get_output_embeddings().weight is model.embed_tokens.weight  # the head is the embedding (tied)
    buffers = dict(model.named_buffers())
    for i in range(reference.config.num_hidden_layers):
        assert buffers[f"layers.{i}.self_attn.rotary_emb.inv_freq"].dtype == torch.float32
        assert buffers[f"layers.{i}.mlp.engine.fused_route_codes"].dtype == torch.uint8
        assert torch.equal(buffers[f"layers.{i}.mlp.engine.route_table"],
                           reference.layers[i].mlp["engine"].route_table)


def cflib_logits(model: TRMoEModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return (model(torch.tensor([ids])) @ model.head_weight.T)[0]


def padded(rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        pad = [TOKENIZER.eos_token_id] * (width - len(row))
        ids.append(pad + row if side == "left" else row + pad)
        ones, zeros = [1] * len(row), [0] * (width - len(row))
        mask.append(zeros + ones if side == "left" else ones + zeros)
    return torch.tensor(ids), torch.tensor(mask)


PROMPTS = ["12+34=", "reverse planet", "abc", "909+181=", "uppercase hello"]


@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_equal_cflibs_on_a_padded_batch(hub_model, reference: TRMoEModel, side: str):
    model, _ = hub_model
    rows = [TOKENIZER.encode_prompt(prompt) for prompt in PROMPTS]
    ids, mask = padded(rows, side)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    for row, tokens, row_mask in zip(logits, rows, mask):
        torch.testing.assert_close(row[row_mask.bool()], cflib_logits(reference, tokens), rtol=0, atol=1e-5)


def greedy_reference(model: TRMoEModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding: the whole sequence through the model for every new token, until EOS."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(cflib_logits(model, tokens)[-1].argmax()))
        if tokens[-1] == TOKENIZER.eos_token_id:
            break
    return tokens[len(prompt):]


@pytest.mark.parametrize("which", ["trained", "varied"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_greedy_generate_on_left_padded_prompts_matches_cflib(request, which: str, use_cache: bool):
    if which == "trained":
        reference, model = request.getfixturevalue("reference"), request.getfixturevalue("hub_model")[0]
    else:
        reference, model = request.getfixturevalue("varied")
    rows = [TOKENIZER.encode_prompt(prompt) for prompt in PROMPTS]
    ids, mask = padded(rows, "left")
    new_tokens = 12
    lengths: list[int] = []
    hook = model.embed_tokens.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             use_cache=use_cache, pad_token_id=TOKENIZER.eos_token_id)
    finally:
        hook.remove()
    # With the cache, every step after the prompt feeds only the newest token; without, the whole sequence.
    width = ids.shape[1]
    assert lengths == [width] + ([1] * (len(lengths) - 1) if use_cache else list(range(width + 1,
                                                                                       width + len(lengths))))
    expected = [greedy_reference(reference, row, new_tokens) for row in rows]
    if which == "varied":
        assert all(len(set(tokens)) > 5 for tokens in expected)
    else:  # the trained model ends its answers, at different steps per row
        assert len({len(tokens) for tokens in expected}) > 1
    for generated, want in zip(out[:, width:].tolist(), expected):
        assert generated[:len(want)] == want
        assert all(token == TOKENIZER.eos_token_id for token in generated[len(want):])  # padding after EOS
    if cflib_generate is not None:
        assert [list(t) for t in cflib_generate(reference, rows, new_tokens, eos_token_id=0)] == expected


def test_the_command_line_exports_a_checkpoint(run_dir: Path, tmp_path: Path, capsys):
    export_main(["hub", str(run_dir / "checkpoints" / "last"), str(tmp_path / "cli"), "--tokenizer", "byte"])
    assert f"exported checkpoint {run_dir / 'checkpoints' / 'last'}" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == BUNDLE_FILES
    assert [p.name for p in tmp_path.iterdir()] == ["cli"]  # no staging or retired folder left beside it


# --- bad inputs: a clear error, nothing written -------------------------------------------------
def test_an_existing_out_folder_is_refused_untouched(run_dir: Path, tmp_path: Path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=re.escape(f"{out} already exists")):
        export_hub(run_dir, out, echo=None)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit, match="export: .* already exists"):
        export_main(["hub", str(run_dir), str(out)])


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path):
    torch.manual_seed(0)
    small = TRMoEModel(smoke_config(vocab_size=200))
    checkpoint = save_checkpoint(small, tmp_path / "small")
    with pytest.raises(TokenizerExportError, match="produces ids up to 259, but the model's vocab_size is 200"):
        export_hub(checkpoint, tmp_path / "out", tokenizer="byte", echo=None)
    with pytest.raises(TokenizerExportError, match="vocab_size is 200, not the byte tokenizer's 260"):
        export_hub(checkpoint, tmp_path / "out", echo=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]


def test_disagreeing_derived_buffers_are_refused(run_dir: Path, tmp_path: Path):
    checkpoint = tmp_path / "ckpt"
    save_checkpoint(load_checkpoint(run_dir / "checkpoints" / "best"), checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["layers.1.mlp.engine.fused_route_codes"][17] ^= 8
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("layers.1.mlp.engine.fused_route_codes disagrees with "
                                                        "layers.1.mlp.engine.route_table at token 17")):
        export_hub(checkpoint, tmp_path / "out", echo=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_route_table_the_hub_layout_cannot_hold_is_refused(tmp_path: Path):
    model = TRMoEModel(smoke_config())
    model.layers[1].mlp["engine"].route_table[1, 5] = model.layers[1].mlp["engine"].route_table[0, 5]
    checkpoint = save_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(ExportError, match="layers.1.mlp.engine.route_table routes token 5 to expert .* twice"):
        export_hub(checkpoint, tmp_path / "out", echo=None)
    assert not (tmp_path / "out").exists()


def test_a_folder_without_checkpoints_is_refused(tmp_path: Path):
    with pytest.raises(ExportError, match="neither a checkpoint .* nor a run folder"):
        export_hub(tmp_path, tmp_path / "out", echo=None)
    adapters = tmp_path / "lora-run" / "checkpoints" / "best"
    adapters.mkdir(parents=True)
    (adapters / "adapter_config.json").write_text("{}")
    with pytest.raises(ExportError, match="holds LoRA adapters, not a model: merge them"):
        export_hub(tmp_path / "lora-run", tmp_path / "out", echo=None)
    assert not (tmp_path / "out").exists()
    (tmp_path / "checkpoints" / ".best.tmp").mkdir(parents=True)
    with pytest.raises(ExportError, match="no checkpoint in it"):
        export_hub(tmp_path, tmp_path / "out", echo=None)


def test_without_best_the_newest_checkpoint_is_exported(tmp_path: Path):
    run = tmp_path / "run"
    model = TRMoEModel(smoke_config())
    for name in ("epoch-9", "epoch-10", "step-40"):
        save_checkpoint(model, run / "checkpoints" / name)
    lines: list[str] = []
    export_hub(run, tmp_path / "a", echo=lines.append)
    assert lines[0] == f"exported {run / 'checkpoints' / 'epoch-10'}: no best or last checkpoint; the newest epoch " \
                       "checkpoint"
    save_checkpoint(model, run / "checkpoints" / "last")
    export_hub(run, tmp_path / "b", echo=lines.append)
    assert f"exported {run / 'checkpoints' / 'last'}: no best checkpoint; the run's final weights" in lines
