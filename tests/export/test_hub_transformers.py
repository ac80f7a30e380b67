"""The bundle as a transformers model: caches, attention implementations, packed rows, loss, checkpointing."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers  # the test extra: the bundle is for it; cflib never imports it
from transformers import DynamicCache, StaticCache

from cflib.export import export_hub
from cflib.model import TRMoEModel, load_checkpoint, preset, save_checkpoint
from cflib.ops.loss import cross_entropy_mean

try:
    from tiny_models import random_ids
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests.tiny_models import random_ids


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[TRMoEModel, Path]:
    """The smoke model with its matrices scaled tenfold (its greedy tokens change at almost every step, so a
    wrong cache, mask or position shows), and its bundle."""
    torch.manual_seed(0)
    model = TRMoEModel(preset("smoke")).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(10.0)
    root = tmp_path_factory.mktemp("transformers")
    return model, export_hub(save_checkpoint(model, root / "ckpt"), root / "bundle", echo=None)


def hub(bundle: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(str(bundle), trust_remote_code=True, **kwargs).eval()


def cflib_logits(model: TRMoEModel, ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, document_ids) @ model.head_weight.T


def left_padded(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(vocab, 3, 9, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def greedy_cflib(model: TRMoEModel, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """One full forward per new token over each row's real tokens."""
    rows = []
    for row, keep in zip(ids, mask):
        tokens = row[keep.bool()].tolist()
        for _ in range(new_tokens):
            tokens.append(int(cflib_logits(model, torch.tensor([tokens]))[0, -1].argmax()))
        rows.append(tokens[-new_tokens:])
    return rows


def generate(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **kwargs) -> list[list[int]]:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, **kwargs)
    return out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_greedy_generate_gives_cflibs_tokens_with_each_cache_and_attention(pair, attn_implementation: str,
                                                                          cache_implementation: str):
    model, bundle = pair
    hub_model = hub(bundle, attn_implementation=attn_implementation)
    assert hub_model.config._attn_implementation == attn_implementation
    ids, mask = left_padded(model.config.vocab_size)
    want = greedy_cflib(model, ids, mask, 10)
    assert sum(len(set(row)) for row in want) > 15  # continuations that move: a wrong step would show
    assert generate(hub_model, ids, mask, 10, cache_implementation=cache_implementation) == want


def test_a_compiled_static_cache_decode_step_has_no_graph_break_and_cflibs_logits(pair):
    """fullgraph=True fails on any graph break or host read (.item(), data-dependent shapes) in the forward."""
    model, bundle = pair
    hub_model = hub(bundle)
    ids = random_ids(model.config.vocab_size, 2, 6, seed=5)
    cache = StaticCache(config=hub_model.config, max_cache_len=16)
    step = torch.compile(hub_model.forward, fullgraph=True, backend="eager")  # dynamo's capture, no C++ build
    tokens = ids
    with torch.no_grad():
        logits = hub_model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for position in range(ids.shape[1], ids.shape[1] + 3):
            token = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, token], 1)
            logits = step(input_ids=token, cache=cache, use_cache=True,
                          position_ids=torch.full((2, 1), position)).logits[:, -1]
            torch.testing.assert_close(logits, cflib_logits(model, tokens)[:, -1], rtol=0, atol=1e-4)


def test_generate_compiles_its_static_cache_decode_step_with_fullgraph_and_gives_cflibs_tokens(pair):
    """What generate(cache_implementation="static") does on a GPU, asked of it here on the CPU: its decode step
    through torch.compile(fullgraph=True) (dynamo's capture; the eager backend spares the C++ build)."""
    from transformers import CompileConfig

    model, bundle = pair
    hub_model = hub(bundle)
    config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told otherwise
    ids, mask = left_padded(model.config.vocab_size)
    tokens = generate(hub_model, ids, mask, 8, cache_implementation="static", compile_config=config)
    assert getattr(hub_model, "_compiled_call", None) is not None  # the decode steps ran compiled
    assert tokens == greedy_cflib(model, ids, mask, 8)


def test_sdpa_never_repeats_a_kv_head(pair, monkeypatch):
    model, bundle = pair
    hub_model = hub(bundle)
    config = model.config
    assert config.num_attention_heads > config.num_key_value_heads  # GQA
    seen: list[tuple[int, int, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        seen.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids, mask = left_padded(config.vocab_size)
    generate(hub_model, ids, mask, 3)
    assert seen and all(kv_heads == config.num_key_value_heads for _, kv_heads, _ in seen)
    prefill = [entry for entry in seen if entry[0] == config.num_attention_heads]
    assert prefill and all(gqa for _, _, gqa in prefill)  # decoding folds the query heads onto their KV head


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_padding_free_rows_keep_each_example_to_itself(pair, attn_implementation: str):
    """Three examples in one row, positions restarting as TRL's padding-free collator writes them: each gets
    the logits it gets alone, as cflib's packed windows do."""
    model, bundle = pair
    hub_model = hub(bundle, attn_implementation=attn_implementation)
    lengths = [5, 3, 7]
    examples = [random_ids(model.config.vocab_size, 1, n, seed=10 + n)[0] for n in lengths]
    packed = torch.cat(examples)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        logits = hub_model(input_ids=packed, position_ids=position_ids).logits[0]
    torch.testing.assert_close(logits, cflib_logits(model, packed, document_ids)[0], rtol=0, atol=1e-5)
    for example, part in zip(examples, logits.split(lengths)):
        torch.testing.assert_close(part, cflib_logits(model, example[None])[0], rtol=0, atol=1e-5)
    with torch.no_grad():  # the same row read as one sequence differs: the boundaries above were honoured
        unpacked = hub_model(input_ids=packed).logits[0]
    assert not torch.allclose(unpacked[5:], logits[5:], atol=1e-3)


def causal_targets(labels: torch.Tensor) -> torch.Tensor:
    """cflib's aligned targets: position t is scored on token t + 1."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


def test_the_loss_honours_num_items_in_batch(pair):
    """Under gradient accumulation transformers passes the whole batch's supervised tokens: each micro-batch's
    loss is its sum over them, so the micro-batches add up to the batch's mean."""
    model, bundle = pair
    hub_model = hub(bundle)
    ids = random_ids(model.config.vocab_size, 4, 10, seed=7)
    labels = ids.clone()
    labels[0, :6] = labels[2, :2] = -100
    supervised = int((causal_targets(labels) != -100).sum())
    with torch.no_grad():
        mean = hub_model(input_ids=ids, labels=labels, use_cache=False).loss
        parts = [hub_model(input_ids=ids[i:i + 1], labels=labels[i:i + 1], use_cache=False,
                           num_items_in_batch=torch.tensor(supervised)).loss for i in range(4)]
        per_row_means = [hub_model(input_ids=ids[i:i + 1], labels=labels[i:i + 1], use_cache=False).loss
                         for i in range(4)]
        hidden = model(ids)
    want = cross_entropy_mean(hidden, model.head_weight, causal_targets(labels))
    torch.testing.assert_close(mean, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum(parts), want, rtol=1e-6, atol=1e-6)
    assert abs(float(sum(per_row_means)) / 4 - float(want)) > 1e-3  # rows of unequal supervision: the naive mean is off


def test_gradient_checkpointing_gives_the_same_gradients(pair):
    model, bundle = pair
    ids = random_ids(model.config.vocab_size, 2, 12, seed=9)

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        hub_model = hub(bundle).train()
        assert hub_model.supports_gradient_checkpointing
        if checkpointing:
            hub_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert all(layer.gradient_checkpointing for layer in hub_model.layers)
        hub_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {name: param.grad for name, param in hub_model.named_parameters()}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and all(grad is not None for grad in plain.values())
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-6, msg=name)


def test_device_map_auto_loads_the_bundle(pair):
    model, bundle = pair
    hub_model = hub(bundle, device_map="auto")  # places whole TRHashDecoderLayers (_no_split_modules)
    placed = {param.device for param in hub_model.parameters()}
    assert placed == {torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")}
    ids = random_ids(model.config.vocab_size, 2, 8, seed=2)
    with torch.no_grad():
        logits = hub_model(input_ids=ids.to(next(iter(placed))), use_cache=False).logits.cpu()
    # On a GPU its matmuls are not the CPU's: the tolerance of the GPU tier's other hub checks
    atol = 1e-5 if next(iter(placed)).type == "cpu" else 1e-4
    torch.testing.assert_close(logits, cflib_logits(model, ids), rtol=0, atol=atol)


def test_a_forward_with_labels_keeps_no_cache_and_decoding_reuses_what_it_derived(pair):
    model, bundle = pair
    hub_model = hub(bundle)
    ids = random_ids(model.config.vocab_size, 1, 6, seed=4)
    engine = hub_model.layers[0].mlp["engine"]
    with torch.no_grad():
        assert hub_model(input_ids=ids, labels=ids).past_key_values is None
        out = hub_model(input_ids=ids, use_cache=True)
        assert isinstance(out.past_key_values, DynamicCache) and out.past_key_values.get_seq_length() == 6
        built = {name: tensor for name, (_, tensor) in engine._derived.items()}
        assert set(built) == {"routed_coefficients", "mlp_in", "mlp_out"}
        hub_model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        assert all(engine._derived[name][1] is tensor for name, tensor in built.items())  # built once, then read
        token = int(ids[0, 0])
        engine.route_table[0, token] = (engine.route_table[0, token] + 1) % model.config.num_experts
        engine.expert_up.mul_(2.0)
        hub_model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)  # a decode step
        rebuilt = {name for name, tensor in built.items() if engine._derived[name][1] is not tensor}
        assert rebuilt == {"routed_coefficients", "mlp_in"}  # their sources changed; the output projections did not
        torch.testing.assert_close(engine._derived["mlp_in"][1][:, -engine.expert_up.shape[2]:],
                                   engine.expert_up[-1])
        stale = engine._derived["mlp_out"][1].clone()
        engine.expert_down.data.mul_(2.0)  # as PEFT merges: neither pointer nor version changes
        hub_model(input_ids=ids, use_cache=False)  # a prefill derives everything anew
        assert not torch.equal(engine._derived["mlp_out"][1], stale)


def test_a_mask_that_does_not_cover_the_cache_is_refused(pair):
    model, bundle = pair
    hub_model = hub(bundle)
    ids = random_ids(model.config.vocab_size, 1, 6, seed=4)
    with torch.no_grad():
        cache = hub_model(input_ids=ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="attention_mask covers 1 positions, but the cache holds 6 and the "
                                             "input 1: it must cover all 7"):
            hub_model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 1), past_key_values=cache)


def test_an_attention_kernel_registered_with_transformers_runs_through_its_interface(pair):
    """The route flash_attention_* take: transformers' attention interface, here with transformers' own SDPA
    function registered under a name of its own (and its mask), packed rows and generate() included."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    calls: list[int] = []

    def counted(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("counted_sdpa", counted)
    AttentionMaskInterface.register("counted_sdpa", sdpa_mask)
    model, bundle = pair
    hub_model = hub(bundle, attn_implementation="counted_sdpa")
    ids, mask = left_padded(model.config.vocab_size)
    assert generate(hub_model, ids, mask, 6) == greedy_cflib(model, ids, mask, 6)
    assert calls and set(calls) == set(range(model.config.num_hidden_layers))
    lengths = [4, 6]
    packed = torch.cat([random_ids(model.config.vocab_size, 1, n, seed=20 + n)[0] for n in lengths])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        logits = hub_model(input_ids=packed, position_ids=position_ids).logits
    torch.testing.assert_close(logits, cflib_logits(model, packed, document_ids), rtol=0, atol=1e-5)


def test_the_frozen_block_computes_what_the_trained_block_computes(pair):
    """Frozen weights (inference, or gradients for the input only) run as two derived GEMMs: same outputs, same
    input gradients; a shared projection wrapped by an adapter keeps the per-weight path."""
    model, bundle = pair
    engine = hub(bundle).layers[0].mlp["engine"]
    x = torch.randn(3, 5, model.config.hidden_size, requires_grad=True)
    ids = random_ids(model.config.vocab_size, 3, 5, seed=6)
    assert not engine.frozen()
    trained = engine(x, ids)
    (trained_grad,) = torch.autograd.grad(trained.square().sum(), x)
    engine.requires_grad_(False)
    assert engine.frozen()
    frozen = engine(x, ids)
    (frozen_grad,) = torch.autograd.grad(frozen.square().sum(), x)
    # fp32 rounding of another summation order, nothing more
    torch.testing.assert_close(frozen, trained, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(frozen_grad, trained_grad, rtol=1e-5, atol=1e-6 * float(trained_grad.abs().max()))
    wrapped = type("AdaptedLinear", (torch.nn.Linear,), {})
    engine.shared_up.__class__ = wrapped
    assert not engine.frozen()


# The smoke model's 256 positions extended to 1,024 by each scaling cflib computes.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 256},  # as a run writes it
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 256, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0},
}


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled_pair(request, tmp_path_factory) -> tuple[TRMoEModel, Path]:
    """The smoke model with a RoPE scaling to 1,024 positions and its matrices scaled tenfold, and its bundle."""
    torch.manual_seed(0)
    config = dataclasses.replace(preset("smoke"), rope_scaling=SCALINGS[request.param], max_position_embeddings=1024)
    model = TRMoEModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(10.0)
    root = tmp_path_factory.mktemp(f"scaled-{request.param}")
    return model, export_hub(save_checkpoint(model, root / "ckpt"), root / "bundle", echo=None)


def test_a_scaled_bundle_computes_cflibs_logits_and_tokens_past_the_original_positions(scaled_pair):
    model, bundle = scaled_pair
    hub_model = hub(bundle)
    assert hub_model.config.rope_scaling_dict() == model.config.rope_scaling
    assert (f"extended to 1,024 positions by RoPE scaling ({model.config.rope_scaling['rope_type']}, factor 4"
            in (bundle / "README.md").read_text())
    ids = random_ids(model.config.vocab_size, 2, 300, seed=7)  # past the 256 positions before the scaling
    with torch.no_grad():
        logits = hub_model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(logits, cflib_logits(model, ids), rtol=0, atol=1e-5)
    positions = torch.arange(1024)[None]
    for got, want in zip(hub_model.layers[0].self_attn.rotary_emb(positions), model.rope(1024, positions.device,
                                                                                          positions)):
        assert torch.equal(got, want)
    mask = torch.ones_like(ids)
    want_tokens = greedy_cflib(model, ids, mask, 6)
    assert sum(len(set(row)) for row in want_tokens) > 6
    assert generate(hub_model, ids, mask, 6) == want_tokens


def test_transformers_reads_a_scaled_bundle_s_rope_as_its_own(scaled_pair, tmp_path, monkeypatch):
    """transformers' own RoPE functions take the bundle's config (rope_parameters, as transformers keeps RoPE), and
    what its save_pretrained writes loads back into cflib with the same scaling. Its validation of rope_parameters
    warns of nothing (a linear scaling's original_max_position_embeddings included)."""
    from transformers import modeling_rope_utils
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model, bundle = scaled_pair
    warned = []
    monkeypatch.setattr(modeling_rope_utils.logger, "warning", lambda message, *args, **kwargs: warned.append(message))
    transformers.AutoConfig.from_pretrained(str(bundle), trust_remote_code=True)
    assert warned == []
    hub_model = hub(bundle)
    config = hub_model.config
    want, factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")
    rotary = hub_model.layers[0].self_attn.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, want, rtol=1e-6, atol=0)
    assert rotary.attention_factor == pytest.approx(factor)
    hub_model.save_pretrained(str(tmp_path / "saved"))
    assert load_checkpoint(tmp_path / "saved").config == model.config
