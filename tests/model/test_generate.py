"""cflib.model.generate: the KV-cache decoder against full forwards without a cache, sampling, bad input."""
from __future__ import annotations

import copy

import pytest
import torch

from cflib.model.fast import use_kernels
from cflib.model.generate import Decoder, GenerationError, Sampling, generate
from cflib.ops.dispatch import KernelChoice

try:
    import sft_shard_helpers as h
    from tiny_models import trained_model
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests import sft_shard_helpers as h
    from tests.tiny_models import trained_model

PROMPTS = ["12+34=", "reverse abc", "58+67=", "reverse planet", "909+181=", "7+1=", "reverse dog", "1+1+1+1+1+1+1="]


@pytest.fixture(scope="module")
def model():
    """Half-trained on the chat examples: partly right answers, varied tokens, some early EOS."""
    return trained_model([e.input_ids for e in h.chat_examples()] + [h.two_turn_example().input_ids], h.VOCAB,
                         steps=25)


def prompts() -> list[list[int]]:
    """Ragged: 3 to 17 tokens, one of them a two-turn conversation."""
    first, _ = h.TOKENIZER.encode_chat("hi", "hello")
    return [h.TOKENIZER.encode_prompt(text) for text in PROMPTS] + [first + h.TOKENIZER.encode_prompt("reverse z")]


def without_cache(model, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """The plain greedy loop: one full forward over the whole sequence per new token, one prompt alone."""
    ids, new = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            hidden = model(torch.tensor([ids], device=model.head_weight.device))[:, -1]
            token = int((hidden @ model.head_weight.t()).argmax(-1))
            new.append(token)
            ids.append(token)
            if token == eos:
                break
    return new


@pytest.mark.parametrize("max_batch", [64, 3])
def test_greedy_matches_full_forwards_for_ragged_batches(model, max_batch):
    expected = [without_cache(model, p, 5, h.EOS) for p in prompts()]
    assert len({len(e) for e in expected}) > 2 and len({t for e in expected for t in e}) > 8  # varied
    assert any(e[-1] == h.EOS for e in expected) and any(e[-1] != h.EOS for e in expected)
    assert generate(model, prompts(), 5, eos_token_id=h.EOS, max_batch=max_batch) == expected


def test_per_prompt_budgets_and_no_eos_stop(model):
    budgets = [1, 7, 3, 12, 2, 5, 9, 4, 6]
    expected = [without_cache(model, p, n, None) for p, n in zip(prompts(), budgets)]
    got = Decoder(model, max_batch=4).generate(prompts(), budgets)
    assert got == expected and [len(g) for g in got] == budgets
    assert any(h.EOS in g[:-1] for g in got)  # went on past an EOS, as asked


def test_tensor_prompts_decode_as_lists_and_the_model_mode_is_kept(model):
    tensors = [torch.tensor(p, dtype=torch.int32) for p in prompts()[:3]]
    model.train()
    try:
        assert generate(model, tensors, 6, h.EOS) == generate(model, prompts()[:3], 6, h.EOS)
        assert model.training
    finally:
        model.eval()


def test_stream_hands_over_every_token_in_order(model):
    seen: dict[int, list[int]] = {}
    got = Decoder(model, max_batch=4).generate(prompts(), 8, h.EOS, stream=lambda i, t: seen.setdefault(i, []).append(t))
    assert seen == dict(enumerate(got))


def test_sampling_repeats_with_a_seed_and_top_k_1_is_greedy(model):
    decoder = Decoder(model, max_batch=4)
    first = decoder.generate(prompts(), 12, h.EOS, temperature=1.5, top_p=0.95, top_k=20, seed=7)
    assert decoder.generate(prompts(), 12, h.EOS, temperature=1.5, top_p=0.95, top_k=20, seed=7) == first
    assert decoder.generate(prompts(), 12, h.EOS, temperature=1.5, top_p=0.95, top_k=20, seed=8) != first
    greedy = decoder.generate(prompts(), 12, h.EOS)
    assert decoder.generate(prompts(), 12, h.EOS, temperature=2.0, top_k=1, seed=1) == greedy
    assert decoder.generate(prompts(), 12, h.EOS, temperature=2.0, top_p=1e-6, seed=1) == greedy


def test_sampler_draws_from_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(40_000, 6)
    generator = torch.Generator().manual_seed(0)

    def frequencies(sampling: Sampling) -> torch.Tensor:
        noise = torch.empty(logits.shape).exponential_(generator=generator)
        return torch.bincount(sampling.choose(logits, noise), minlength=6).double() / logits.shape[0]

    probs = torch.softmax(logits[0].double() / 0.7, -1)
    assert torch.allclose(frequencies(Sampling(temperature=0.7)), probs, atol=0.01)
    top3 = probs[:3] / probs[:3].sum()
    assert torch.allclose(frequencies(Sampling(temperature=0.7, top_k=3)), torch.cat([top3, torch.zeros(3)]),
                          atol=0.01)
    # top_p 0.9: the fewest most likely tokens holding 0.9 of the mass (0.70 + 0.17 < 0.9: three of them)
    kept = int((probs.cumsum(0) - probs <= 0.9).sum())
    nucleus = torch.cat([probs[:kept] / probs[:kept].sum(), torch.zeros(6 - kept)])
    assert kept == 3 and torch.allclose(frequencies(Sampling(temperature=0.7, top_p=0.9)), nucleus, atol=0.01)


@pytest.mark.parametrize("kernels", [KernelChoice(liger=True, custom=False), KernelChoice(liger=True, custom=True)],
                         ids=["liger", "cflib_triton"])
def test_fast_kernels_take_decode_shapes(model, kernels):
    """Liger's RMSNorm/RoPE/SwiGLU and cflib's fused QKV norm+RoPE, add+RMSNorm and TR-MoE block accept one
    token per row at per-row positions, and decode as full forwards through the same kernels do."""
    fast = copy.deepcopy(model).to("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: Triton's interpreter
    use_kernels(fast, kernels)
    ragged = [prompts()[1], prompts()[-1]]
    expected = [without_cache(fast, p, 3, h.EOS) for p in ragged]
    decoder = Decoder(fast)
    assert decoder.generate(ragged, 3, h.EOS) == expected
    path = decoder.path()["kernel_path"]
    assert path["attention"] == "sdpa_kv_cache"
    assert path["moe"] == ("triton_fused" if kernels.custom else "torch_dense")
    assert path["rope"] == ("cflib_qk_norm_rope" if kernels.custom else "liger")


def test_bf16_autocast_decodes(model):
    got = Decoder(model, autocast_dtype=torch.bfloat16).generate(prompts(), 6, h.EOS)
    assert [len(g) for g in got] and all(0 < len(g) <= 6 for g in got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cuda_graph_decodes_as_eager(model, temperature):
    gpu = copy.deepcopy(model).cuda()
    graphed, eager = Decoder(gpu), Decoder(gpu, cuda_graph=False)
    kwargs = dict(eos_token_id=h.EOS, temperature=temperature, top_p=0.9, seed=3)
    assert graphed.generate(prompts(), 12, **kwargs) == eager.generate(prompts(), 12, **kwargs)
    assert graphed.path()["cuda_graph"] and graphed.path()["graphs_captured"] and not eager.path()["cuda_graph"]


def test_bad_input_is_refused_before_any_forward(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    limit = model.config.max_position_embeddings
    try:
        cases = [
            (dict(prompts=[[5] * 10, [5] * (limit - 3)], max_new_tokens=4),
             f"prompt 1: {limit - 3} tokens \\+ max_new_tokens 4 = {limit + 1} exceeds the model's "
             f"max_position_embeddings {limit}"),
            (dict(prompts=[[5] * (limit + 1)], max_new_tokens=1), "exceeds the model's max_position_embeddings"),
            (dict(prompts=[[5, h.VOCAB]], max_new_tokens=1), f"prompt 0: token id {h.VOCAB} is outside"),
            (dict(prompts=[[5], []], max_new_tokens=1), "prompt 1 is empty"),
            (dict(prompts=[], max_new_tokens=1), "non-empty list"),
            (dict(prompts=[[5]], max_new_tokens=0), "max_new_tokens must be a positive integer"),
            (dict(prompts=[[5], [6]], max_new_tokens=[1]), "1 budgets for 2 prompts"),
            (dict(prompts=[[5]], max_new_tokens=1, eos_token_id=h.VOCAB), "eos_token_id 260"),
            (dict(prompts=[[5]], max_new_tokens=1, temperature=-1), "temperature must be"),
            (dict(prompts=[[5]], max_new_tokens=1, temperature=1, top_p=0), "top_p must be in"),
            (dict(prompts=[[5]], max_new_tokens=1, temperature=1, top_k=1.5), "top_k must be"),
        ]
        for kwargs, message in cases:
            with pytest.raises(GenerationError, match=message):
                generate(model, **kwargs)
        with pytest.raises(GenerationError, match="max_batch"):
            Decoder(model, max_batch=0)
        if not torch.cuda.is_available():
            with pytest.raises(GenerationError, match="cuda_graph=True needs"):
                Decoder(model, cuda_graph=True)
    finally:
        handle.remove()
    assert calls == []


def test_a_long_prompt_that_stops_early_beside_a_short_one_that_runs_long(model):
    """The cache is sized by each row's own need; a finished row goes on stepping with the others."""
    limit = model.config.max_position_embeddings
    rows = [prompts()[0] * 10, prompts()[1]]
    rows[0] = rows[0][:limit - 2]
    budgets = [1, limit - len(rows[1])]
    expected = [without_cache(model, p, n, None) for p, n in zip(rows, budgets)]
    assert Decoder(model).generate(rows, budgets) == expected


def test_a_compiled_decode_step_decodes_as_eager(model):
    """torch.compile traces the step through the cache (aot_eager here: the tracing without a C++ build)."""
    decoder = Decoder(model, compile_step="aot_eager")
    assert decoder.generate(prompts(), 6, h.EOS) == Decoder(model).generate(prompts(), 6, h.EOS)
    assert decoder.path()["compiled"] == "aot_eager"


def test_a_decoder_holds_a_few_shapes_and_rebuilds_the_others(model, monkeypatch):
    monkeypatch.setattr("cflib.model.generate.MAX_SLOTS", 2)
    decoder = Decoder(model, max_batch=2)
    expected = [without_cache(model, p, 3, h.EOS) for p in prompts()[:2]]
    assert decoder.generate(prompts()[:2], 3, h.EOS) == expected
    assert decoder.generate(prompts()[:1], 3, h.EOS) == expected[:1]
    assert decoder.generate(prompts()[:2], 3, h.EOS, temperature=1.0, top_k=1, seed=0) == expected  # a third shape
    assert decoder.path()["shapes_held"] == ["batch 1 x length 64 (greedy)", "batch 2 x length 64 (sampling)"]
    assert decoder.generate(prompts()[:2], 3, h.EOS) == expected  # the first shape, built again
    assert decoder.path()["shapes_held"] == ["batch 2 x length 64 (sampling)", "batch 2 x length 64 (greedy)"]
    decoder.release()
    assert decoder.path()["shapes_held"] == [] and decoder.path()["kv_cache_bytes"] == 0
