"""RoPE scaling (cflib.model.rope, ModelConfig.rope_scaling): transformers' frequencies, the config's contract, and
the model's tables, fast paths and KV-cache decoding with a scaling on."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny_models import KERNEL_DEVICE, random_ids, tiny_model

from cflib.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from cflib.model.config import ConfigError, ModelConfig, preset
from cflib.model.decoder import TRMoEModel
from cflib.model.derived import INV_FREQ_RTOL
from cflib.model.fast import use_kernels
from cflib.model.generate import generate
from cflib.model.rope import attention_factor, plain_inv_freq, rope_inv_freq
from cflib.ops.dispatch import KernelChoice

LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}

# (head_dim, rope_theta, max_position_embeddings, rope_scaling): the 200M model's head, Llama 3.1's, YaRN's options.
TRANSFORMERS_CASES = [
    (64, 10000.0, 8192, LINEAR),
    (64, 10000.0, 8192, {**YARN, "original_max_position_embeddings": 2048}),
    (64, 1e6, 8192, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "beta_fast": 16.0,
                     "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False}),
    (128, 500000.0, 131072, LLAMA3),
]


@pytest.mark.parametrize("head_dim, theta, positions, scaling", TRANSFORMERS_CASES,
                         ids=["linear", "yarn", "yarn-options", "llama3"])
def test_each_scaling_gives_transformers_frequencies_and_attention_factor(head_dim, theta, positions, scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=positions,
                                      rope_parameters={**scaling, "rope_theta": theta})
    want, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    got = rope_inv_freq(head_dim, theta, ModelConfig(rope_scaling=scaling).rope_scaling)
    # transformers computes in float32, cflib in float64 rounded once: an ulp or two apart
    torch.testing.assert_close(got, want, rtol=INV_FREQ_RTOL, atol=0.0)
    assert attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)


def test_llama3_keeps_the_high_frequencies_divides_the_low_and_blends_between():
    ratio = rope_inv_freq(128, 500000.0, LLAMA3).double() / plain_inv_freq(128, 500000.0)
    kept, divided = torch.isclose(ratio, torch.ones(1, dtype=torch.float64)), torch.isclose(
        ratio, torch.full((1,), 1 / 8, dtype=torch.float64))
    assert kept[0] and divided[-1] and bool((~kept & ~divided).any())


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type 'dynamic' is not supported"),
    ({"rope_type": "ntk", "factor": 2.0}, "rope_scaling.rope_type must be one of linear, yarn, llama3"),
    ({"factor": 2.0}, "rope_scaling.rope_type must be one of"),
    ({"rope_type": "linear"}, "rope_scaling: rope_type linear needs factor"),
    ({"rope_type": "linear", "factor": 0.5}, "rope_scaling.factor must be at least 1"),
    ({"rope_type": "linear", "factor": float("nan")}, "rope_scaling.factor must be a finite number"),
    ({"rope_type": "linear", "factor": True}, "rope_scaling.factor must be a finite number"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "set rope_theta on its own"),
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type yarn needs original_max_position_embeddings"),
    ({**YARN, "original_max_position_embeddings": 64.5}, "original_max_position_embeddings must be a positive integer"),
    ({**YARN, "mscale": 1.0}, "'mscale' is not a key of rope_type yarn"),
    ({**YARN, "beta_fast": 0.5}, "beta_fast 0.5 must be more than beta_slow 1"),
    ({**YARN, "truncate": "no"}, "rope_scaling.truncate must be true or false"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "high_freq_factor 1 must be more than low_freq_factor 1"),
    ("linear", "rope_scaling must be None or a mapping"),
])
def test_a_bad_scaling_is_refused_naming_the_key(scaling, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        ModelConfig(rope_scaling=scaling)


def test_config_json_reads_transformers_names_and_writes_the_canonical_dict():
    legacy = ModelConfig.from_dict({"rope_scaling": {"type": "linear", "factor": 4}})
    assert legacy.rope_scaling == LINEAR and ModelConfig.from_dict(legacy.to_dict()) == legacy
    # transformers' save_pretrained writes RoPE as rope_parameters, rope_theta inside
    saved = ModelConfig.from_dict({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                       "original_max_position_embeddings": 64}})
    assert (saved.rope_theta, saved.rope_scaling) == (1e6, YARN)
    plain = ModelConfig.from_dict({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert (plain.rope_theta, plain.rope_scaling) == (5e5, None)
    with pytest.raises(ConfigError, match="cfg: rope_parameters.rope_theta 1000000.0 disagrees with rope_theta"):
        ModelConfig.from_dict({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                              source="cfg")


def test_linear_scaling_may_name_the_positions_before_it_which_change_no_frequency():
    """A linear dict may carry original_max_position_embeddings (cflib.train.positions reads it, runs write it):
    kept in the canonical dict, checked as yarn's is, and Position Interpolation's frequencies are factor's alone."""
    named = ModelConfig(rope_scaling={**LINEAR, "original_max_position_embeddings": 512}).rope_scaling
    assert named == {**LINEAR, "original_max_position_embeddings": 512} and named != LINEAR
    assert torch.equal(rope_inv_freq(64, 10000.0, named), rope_inv_freq(64, 10000.0, LINEAR))
    with pytest.raises(ConfigError, match="rope_scaling.original_max_position_embeddings must be a positive integer"):
        ModelConfig(rope_scaling={**LINEAR, "original_max_position_embeddings": 0})


def test_linear_scaling_turns_position_t_times_factor_as_plain_rope_turns_t():
    plain, scaled = tiny_model(), tiny_model(rope_scaling={"rope_type": "linear", "factor": 2.0})
    cos, sin = scaled.rope(64, torch.device("cpu"))
    want_cos, want_sin = plain.rope(32, torch.device("cpu"))
    assert torch.equal(cos[::2], want_cos) and torch.equal(sin[::2], want_sin)  # dividing by 2 is exact


def test_yarn_scales_every_table_by_its_attention_factor():
    model = tiny_model(rope_scaling=YARN)
    factor = 0.1 * math.log(4.0) + 1.0
    cos, sin = model.rope(5, torch.device("cpu"))
    by_position, _ = model.rope(5, torch.device("cpu"), torch.arange(5)[None])
    assert model.rope_attention_factor == pytest.approx(factor)
    torch.testing.assert_close(cos.pow(2) + sin.pow(2), torch.full_like(cos, factor**2))
    torch.testing.assert_close(by_position[0], cos, rtol=0, atol=1e-6)


def test_set_positions_takes_a_scaling_and_refuses_any_other_change():
    model = tiny_model()
    scaled = ModelConfig(**{**model.config.to_dict(), "rope_scaling": YARN, "max_position_embeddings": 256})
    model.set_positions(scaled)
    assert model.config == scaled and model.rope_attention_factor > 1
    torch.testing.assert_close(model.inv_freq, rope_inv_freq(8, 10000.0, YARN), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"not \['vocab_size'\]"):
        model.set_positions(ModelConfig(**{**scaled.to_dict(), "vocab_size": 60}))


def test_a_scaled_checkpoint_reloads_with_its_scaling_and_a_wrong_stored_frequency_is_refused(tmp_path):
    model = tiny_model(rope_scaling=LLAMA3 | {"original_max_position_embeddings": 32})
    loaded = load_checkpoint(save_checkpoint(model, tmp_path / "ckpt"))
    ids = random_ids(50, 1, 40)
    assert loaded.config == model.config
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    unscaled = tiny_model()  # the frequencies of plain RoPE, under a config that says llama3
    save_checkpoint(unscaled, tmp_path / "plain")
    (tmp_path / "plain" / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="rotary_emb.inv_freq disagrees with rope_theta 10000.0, rope_scaling"):
        load_checkpoint(tmp_path / "plain")


def _loss_and_grads(model, kernels: KernelChoice, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    use_kernels(model, kernels)
    model.zero_grad()
    out = model(ids)
    loss = (out.float() @ model.head_weight.T).logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def test_the_fused_qk_norm_rope_path_keeps_qkv_under_yarn_and_matches_the_reference():
    """The fused kernel's backward recovers the normed heads by undoing the rotation, which YaRN's attention factor
    makes no rotation: with it, the kept-qkv backward runs, and the gradients are the reference's."""
    torch.manual_seed(0)
    model = tiny_model(rope_scaling=YARN, max_position_embeddings=128).to(KERNEL_DEVICE).train()
    ids = random_ids(50, 2, 96).to(KERNEL_DEVICE)
    want_loss, want = _loss_and_grads(model, KernelChoice(liger=False, custom=False), ids)
    loss, grads = _loss_and_grads(model, KernelChoice(liger=True, custom=True), ids)
    assert model.kernel_path()["qk_norm_backward"] == "kept_qkv"
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_liger_rope_takes_yarn_tables_forward_and_backward():
    torch.manual_seed(0)
    model = tiny_model(rope_scaling=YARN, max_position_embeddings=128).to(KERNEL_DEVICE).train()
    ids = random_ids(50, 1, 12).to(KERNEL_DEVICE)  # Triton's interpreter pays per row
    want_loss, want = _loss_and_grads(model, KernelChoice(liger=False, custom=False), ids)
    loss, grads = _loss_and_grads(model, KernelChoice(liger=True, custom=False), ids)
    assert model.kernel_path()["rope"] == "liger"
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("scaling", [LINEAR, {**YARN, "original_max_position_embeddings": 256}],
                         ids=["linear", "yarn"])
def test_kv_cache_decoding_past_the_original_positions_matches_full_forwards(scaling):
    """The smoke model (256 positions) extended to 1,024, its matrices scaled tenfold so that its greedy tokens
    move at every step, decoding after a prompt of 300 tokens."""
    torch.manual_seed(0)
    model = TRMoEModel(dataclasses.replace(preset("smoke"), rope_scaling=scaling, max_position_embeddings=1024)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(10.0)
    prompt = random_ids(260, 1, 300, seed=4)[0].tolist()
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(8):
            token = int((model(torch.tensor([ids]))[0, -1] @ model.head_weight.T).argmax())
            want.append(token)
            ids.append(token)
    assert len(set(want)) > 3
    assert generate(model, [prompt], 8) == [want]
