"""The bundle's own modules (hub_modules/) as transformers runs them: new models, the cache, both directions of files."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers  # the test extra: the bundle is for it; cflib never imports it

from cflib.export import export_hub
from cflib.model import ModelConfig, TRMoEModel, load_checkpoint, preset, save_checkpoint
from cflib.model.derived import derived_buffers

try:
    from tiny_models import random_ids
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests.tiny_models import random_ids



@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[TRMoEModel, Path]:
    torch.manual_seed(0)
    model = TRMoEModel(preset("smoke")).eval()
    root = tmp_path_factory.mktemp("modules")
    return model, export_hub(save_checkpoint(model, root / "ckpt"), root / "bundle", echo=None)


def cflib_logits(model: TRMoEModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids) @ model.head_weight.T


def hub(bundle: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(bundle), trust_remote_code=True).eval()


@pytest.mark.parametrize("strategy", ["token_id_multi_hash", "modulo_cyclic"])
@pytest.mark.parametrize("experts, top_k", [(4, 2), (6, 2), (5, 3)])
def test_a_new_model_builds_cflibs_route_tables_and_derived_buffers(pair, strategy: str, experts: int, top_k: int):
    fields = {**preset("smoke").to_dict(), "routing_strategy": strategy, "num_experts": experts,
              "intermediate_size": 16 * experts, "num_experts_per_tok": top_k, "route_hash_count": top_k}
    config = transformers.AutoConfig.from_pretrained(str(pair[1]), trust_remote_code=True, **fields)
    fresh = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    ours = TRMoEModel(ModelConfig(**fields))
    state = ours.state_dict()
    want = {**state, **derived_buffers(ours.config, state)}
    got = fresh.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        if not tensor.dtype.is_floating_point or name.endswith("inv_freq"):
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_cflib_loads_what_transformers_saves(pair, tmp_path: Path):
    model, bundle = pair
    hub(bundle).save_pretrained(str(tmp_path / "saved"))
    ids = random_ids(model.config.vocab_size, 2, 11)
    assert torch.equal(cflib_logits(load_checkpoint(tmp_path / "saved").eval(), ids), cflib_logits(model, ids))


def test_a_second_chunk_through_the_cache_equals_one_full_pass(pair):
    """Prefill in two chunks: the second attends to the cache and causally within itself."""
    model, bundle = pair
    hub_model = hub(bundle)
    ids = random_ids(model.config.vocab_size, 2, 10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 is left-padded
    with torch.no_grad():
        first = hub_model(input_ids=ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        cache = getattr(first, "cache", None) or first.past_key_values
        second = hub_model(input_ids=ids[:, 6:], attention_mask=mask, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(second.logits[0], cflib_logits(model, ids[:1])[0, 6:], rtol=0, atol=1e-5)
    torch.testing.assert_close(second.logits[1], cflib_logits(model, ids[1:, 3:])[0, 3:], rtol=0, atol=1e-5)


def test_labels_give_the_next_token_loss(pair):
    model, bundle = pair
    ids = random_ids(model.config.vocab_size, 2, 9)
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        loss = hub(bundle)(input_ids=ids, labels=labels, use_cache=False).loss
    want = F.cross_entropy(cflib_logits(model, ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


def test_half_precision_keeps_exact_rope_angles(pair):
    """model.to(bfloat16) rounds the inv_freq buffer; the angles come from the config, as cflib's do."""
    model, bundle = pair
    rotary = hub(bundle).to(torch.bfloat16).layers[0].self_attn.rotary_emb
    assert rotary.inv_freq.dtype == torch.bfloat16
    assert not torch.equal(rotary.inv_freq.float(), model.inv_freq)  # rounding that would move late positions
    positions = torch.arange(model.config.max_position_embeddings)[None]
    for got, want in zip(rotary(positions), model.rope(positions.shape[1], positions.device, positions)):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_the_configuration_refuses_what_the_model_cannot_be(pair):
    config_class = type(transformers.AutoConfig.from_pretrained(str(pair[1]), trust_remote_code=True))
    with pytest.raises(ValueError, match="tie_word_embeddings must be true"):
        config_class(tie_word_embeddings=False)
    with pytest.raises(ValueError, match=re.escape("head_dim 32 is not hidden_size / num_attention_heads = 64")):
        config_class(head_dim=32)
    with pytest.raises(ValueError, match="not divisible by num_experts"):
        config_class(intermediate_size=250)


def test_inputs_embeds_alone_are_refused(pair):
    hub_model = hub(pair[1])
    with pytest.raises(ValueError, match="routes each token by its id: pass input_ids"):
        hub_model(inputs_embeds=torch.zeros(1, 3, pair[0].config.hidden_size))
