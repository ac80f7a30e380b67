"""The micro-step replayed from CUDA graphs (cflib.train.graphs): the padding that makes shapes static changes no
loss or gradient, and on a GPU the graphed steps train exactly as the eager ones.

The padding tests run the production kernels where the fast kernels run (the GPU, else Triton's interpreter);
the replay tests need CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sft_shard_helpers import task_shard
from tiny_models import KERNEL_DEVICE, random_ids, tiny_config

from cflib.errors import KernelUnavailable
from cflib.model.fast import build_model
from cflib.ops.attention import pack_documents
from cflib.ops.dispatch import KernelChoice
from cflib.ops.loss import supervised_positions
from cflib.ops.rows import Rows
from cflib.ops.sft_loss import SFTLoss
from cflib.train.batch import MicroBatch
from cflib.train.graphs import padded, static_shape
from cflib.train.params import TrainParams
from cflib.train.run import prepare
from cflib.train.trainer import Trainer

PRODUCTION = KernelChoice(liger=True, custom=True)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _host_batch(vocab: int, rows: int, seq: int, packed: bool, weighted: bool) -> MicroBatch:
    ids = random_ids(vocab, rows, seq)
    labels = random_ids(vocab, rows, seq, seed=1)
    labels[:, : seq // 3] = -100
    labels[-1, seq - 5:] = -100  # a shorter last row, padded as collate pads it
    documents = None
    if packed:
        document_ids = torch.zeros(rows, seq, dtype=torch.long)
        document_ids[:, seq // 2:] = 1
        document_ids[0, seq - 3:] = 2
        documents = pack_documents(document_ids)
    weights = torch.rand(rows, seq, generator=torch.Generator().manual_seed(2)) * 3 if weighted else None
    return MicroBatch(ids, labels, documents, weights, supervised_positions(labels))


def _loss_and_grads(model, batch: MicroBatch, gathered: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """gathered: as the trainer runs the SFT loss, the last layer computing the supervised rows alone."""
    loss = SFTLoss(PRODUCTION)
    model.zero_grad(set_to_none=True)
    extra = {} if batch.row_mask is None else {"row_mask": batch.row_mask}
    if gathered:
        hidden = model(batch.input_ids, batch.documents, rows=Rows(batch.supervised, batch.row_mask))
        extra["gathered"] = True
    else:
        hidden = model(batch.input_ids, batch.documents)
    loss_sum, _ = loss(hidden, model.head_weight, batch.labels, 16, True, token_weights=batch.token_weights,
                       supervised=batch.supervised, **extra)
    loss_sum.backward()
    return loss_sum.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def small_multiples(monkeypatch):
    """The padding's multiples scaled down (the same rules, a fraction of the interpreted work): rows to 64
    tokens, supervised positions to 128, a packed batch's documents to 8."""
    import cflib.train.graphs as graphs

    for name, value in (("SEQ_MULTIPLE", 64), ("SUPERVISED_ROWS", 128), ("DOCUMENTS", 8)):
        monkeypatch.setattr(graphs, name, value)
    return graphs


@pytest.mark.slow  # the model's forward and backward in Triton's interpreter, twice a case: ~6 s each on two cores
@pytest.mark.parametrize("packed,weighted", [(False, False), (False, True), (True, False)],
                         ids=["dense", "dense-weighted", "packed"])
def test_padding_to_a_static_shape_keeps_the_loss_and_every_gradient(packed, weighted, small_multiples):
    """Dense rows padded to the next multiple of SEQ_MULTIPLE tokens, supervised positions to a multiple of
    SUPERVISED_ROWS (rows of weight 0), a packed batch's documents to a multiple of DOCUMENTS (empty
    documents): the same loss and gradients, also where the last layer computes the supervised rows alone
    (padding entries repeating one, masked out of the gradient). Heads of 64, so that on a GPU packed windows
    run FlashAttention-4's varlen kernel where it is installed, the kernel whose document table is padded."""
    torch.manual_seed(0)
    config = tiny_config(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512)
    model = build_model(config, PRODUCTION).to(KERNEL_DEVICE).train()
    host = _host_batch(config.vocab_size, 3, 40, packed, weighted)
    shape = static_shape(host, seq_len=300)
    rows, documents = small_multiples.SUPERVISED_ROWS, small_multiples.DOCUMENTS
    assert shape.supervised == rows and shape.weighted == weighted
    assert (shape.seq, shape.documents) == ((40, documents) if packed else (small_multiples.SEQ_MULTIPLE, None))
    wide = padded(host, shape, pad_token_id=0)
    assert wide.input_ids.shape == (3, shape.seq) and wide.supervised.shape == wide.row_mask.shape == (rows,)
    if packed:
        assert wide.documents.cu_seqlens.shape == (documents + 1,)
    loss, grads = _loss_and_grads(model, host.to(KERNEL_DEVICE))
    for gathered in (False, True):  # every row, or the supervised rows alone
        wide_loss, wide_grads = _loss_and_grads(model, wide.to(KERNEL_DEVICE), gathered)
        assert wide_loss == pytest.approx(loss, rel=1e-5), gathered
        for name, grad in grads.items():
            # The padded GEMMs sum the same terms (and zeros) in another order: entries that cancel to near zero
            # differ by the rounding of the terms' scale.
            torch.testing.assert_close(wide_grads[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()),
                                       msg=lambda m, name=name, gathered=gathered: f"{name} (rows {gathered}): {m}")


def test_static_shapes_round_up_and_a_batch_without_supervision_has_none():
    host = _host_batch(50, 2, 300, packed=False, weighted=False)
    shape = static_shape(host, seq_len=300)
    assert (shape.rows, shape.seq, shape.supervised) == (2, 300, 512)  # 512 capped at seq_len
    host.supervised = host.supervised[:0]
    assert static_shape(host, seq_len=300) is None


def _params(tmp_path, shard, **overrides) -> TrainParams:
    return TrainParams.from_dict({"model": "smoke", "data": str(shard), "out_dir": str(tmp_path / "run"),
                                  "seq_len": 64, "micro_batch_per_rank": 4, "global_batch": 8, "max_steps": 6,
                                  "eval_at_start": False, "exact_match_limit": 0, **overrides})


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    return task_shard(tmp_path_factory.mktemp("shard"), 48, 8, seed=1)


def test_cuda_graphs_true_without_a_gpu_stops_before_any_step(tmp_path, shard):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(KernelUnavailable, match="cuda_graphs: true, but the device is cpu"):
        Trainer(prepare(_params(tmp_path, shard, device="cpu", kernel_overrides={"cuda_graphs": True})), progress=False)
    trainer = Trainer(prepare(_params(tmp_path, shard, device="cpu", out_dir=str(tmp_path / "auto"))),
                      progress=False)
    assert trainer.training_step.graphs_summary() == {"cuda_graphs": False, "reason": "the device is cpu, not CUDA"}


@CUDA
@pytest.mark.parametrize("pack", [False, True], ids=["dense", "packed"])
def test_graphed_steps_train_as_the_eager_steps(tmp_path, shard, pack):
    """Six steps of two micro-batches each, replayed from graphs after each shape's eager warm-up and capture
    (each step's batches staged during the step before), against the same steps launched from the host and
    collated in their own step: the same losses and gradient norms, and the same updates
    (AdamW turns rounding-level gradient differences of near-zero entries into steps of lr, so the weights are
    compared as a whole: the two runs' updates differ by a small part of their size)."""
    common = {"device": "cuda", "bf16": True, "use_custom_kernels": True, "pack_sequences": pack, "seed": 3}
    trainers = {}
    for graphs in ("true", "false"):
        params = _params(tmp_path / graphs, shard, kernel_overrides={"cuda_graphs": graphs}, **common)
        try:
            trainers[graphs] = Trainer(prepare(params), progress=False)
        except KernelUnavailable as err:  # packed windows capture only with FlashAttention-4
            pytest.skip(str(err))
    start = {name: p.detach().clone() for name, p in trainers["false"].model.named_parameters()}
    rows = {}
    for graphs, trainer in trainers.items():
        units = len(trainer.run.packed) if pack else len(trainer.run.train_data)
        order = np.random.default_rng(0).permutation(units)
        steps = [order[s * 8 % (units - 8):][:8] for s in range(6)] + [None]
        # The graphed run stages each next step (padded, pinned) during the current one, as fit() does.
        rows[graphs] = [trainer.train_step(steps[s], steps[s + 1] if graphs == "true" else None) for s in range(6)]
    summary = trainers["true"].training_step.graphs_summary()
    assert summary["replayed"] > 0 and summary["captured"] >= 2 and summary["capture_failure"] is None, summary
    assert trainers["true"].training_step.loss.last_backend == "cflib_triton_fused_linear_ce"
    for graphed, eager in zip(rows["true"], rows["false"]):
        assert graphed["loss"] == pytest.approx(eager["loss"], rel=2e-3)
        assert graphed["grad_norm"] == pytest.approx(eager["grad_norm"], rel=2e-2)
        assert graphed["tokens"] == eager["tokens"]
    weights = [dict(t.model.named_parameters()) for t in trainers.values()]
    for name, parameter in weights[0].items():
        update = (weights[1][name] - start[name]).norm()
        assert (parameter - weights[1][name]).norm() <= 0.1 * update, name


@CUDA
@pytest.mark.parametrize("max_shapes", [8, 1], ids=["all-captured", "one-shape-held"])
def test_steps_mixing_shapes_accumulate_the_eager_gradients(monkeypatch, max_shapes):
    """Steps of two micro-batches whose shapes change from step to step (and, with one shape held, some of them
    run eagerly beside graphs): each step's gradients are the eager steps' on the unpadded batches."""
    import cflib.train.graphs as graphs_module
    from cflib.train.graphs import GraphedMicroSteps

    monkeypatch.setattr(graphs_module, "MAX_SHAPES", max_shapes)
    torch.manual_seed(0)
    config = tiny_config(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512)
    model = build_model(config, PRODUCTION).cuda().train()
    loss = SFTLoss(PRODUCTION)

    def forward_backward(batch: MicroBatch, scale, capturing: bool) -> torch.Tensor:
        rows = {} if batch.row_mask is None else {"row_mask": batch.row_mask}
        loss_sum, _ = loss(model(batch.input_ids, batch.documents), model.head_weight, batch.labels, 64, True,
                           supervised=batch.supervised, **rows)
        (loss_sum * scale).backward()
        return loss_sum.detach()

    graphed = GraphedMicroSteps(forward_backward, list(model.parameters()), torch.device("cuda"), 512, 0)
    short, long = (_host_batch(config.vocab_size, 2, seq, False, False) for seq in (40, 300))
    for step, pair in enumerate([(short, long), (short, short), (long, short), (short, long), (short, long),
                                 (long, long), (long, short), (short, short)]):
        for parameter in model.parameters():
            parameter.grad = None
        for host in pair:
            forward_backward(host.to("cuda"), 0.5, False)
        eager = {name: p.grad.clone() for name, p in model.named_parameters()}
        for parameter in model.parameters():
            parameter.grad = None
        for index, host in enumerate(pair):
            graphed(host, 0.5, accumulate=index > 0)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, eager[name], rtol=1e-4, atol=1e-5 * float(eager[name].abs().max()),
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")
    summary = graphed.summary()
    assert summary["replayed"] > 0 and summary["capture_failure"] is None, summary
    assert summary["shapes"] <= max_shapes


@CUDA
def test_neftune_s_noise_is_drawn_afresh_in_every_replay(tmp_path, shard):
    """NEFTune's generator is registered with every capture: steps replayed from graphs advance it as eager steps
    do, so each replay adds new noise, and the step's kernel path reads back that the noise ran."""
    params = _params(tmp_path, shard, device="cuda", bf16=True, use_custom_kernels=True, neftune_noise_alpha=5.0,
                     kernel_overrides={"cuda_graphs": True})
    trainer = Trainer(prepare(params), progress=False)
    generator = trainer.training_step.noise.generator
    assert generator.device.type == "cuda"
    order = np.random.default_rng(0).permutation(len(trainer.run.train_data))
    offsets = [generator.get_offset()]
    for step in range(6):
        trainer.train_step(order[step * 8 % 40:][:8])
        offsets.append(generator.get_offset())
    summary = trainer.training_step.graphs_summary()
    assert summary["replayed"] > 0 and summary["capture_failure"] is None, summary
    assert all(after > before for before, after in zip(offsets, offsets[1:])), offsets
    assert trainer.training_step.kernel_path["embedding_noise"] == "neftune"
