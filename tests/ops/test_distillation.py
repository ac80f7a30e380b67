"""The distillation loss (cflib.ops.distillation) beside the full-logit loss in float64: (1 - r) CE + r tau^2
KL(teacher || student) over the supervised tokens, its gradients for the student's hidden states and head; at r = 0
the chunked cross-entropy's own numbers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from tiny_models import KERNEL_DEVICE

from cflib.ops.distillation import DistillationLoss
from cflib.ops.loss import IGNORE_INDEX, chunked_cross_entropy_sum

ROWS, DIM, TEACHER_DIM, VOCAB = 19, 16, 24, 300  # a teacher wider than its student


def reference(hidden, head, token_weights=None, *, teacher_hidden, teacher_head, labels, ratio, temperature,
              dft=False):
    """The loss on the full logits, as its definition reads (torch's kl_div: KL(teacher || student))."""
    supervised = labels != IGNORE_INDEX
    student = (hidden @ head.t())[supervised]
    teacher = (teacher_hidden @ teacher_head.t())[supervised]
    ce = F.cross_entropy(student, labels[supervised], reduction="none")
    if dft:
        ce = ce * torch.exp(-ce).detach()
    kl = F.kl_div(F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1),
                  log_target=True, reduction="none").sum(-1)
    losses = (1 - ratio) * ce + ratio * temperature ** 2 * kl
    return (losses * token_weights[supervised]).sum() if token_weights is not None else losses.sum()


def problem(seed: int, weighted: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """The student's leaves (hidden, head, token weights), the teacher's tensors, and labels with ignored rows."""
    gen = torch.Generator().manual_seed(seed)
    student = {"hidden": torch.randn(ROWS, DIM, generator=gen), "head": torch.randn(VOCAB, DIM, generator=gen) * 0.4}
    if weighted:
        student["token_weights"] = torch.rand(ROWS, generator=gen) * 3
    teacher = {"teacher_hidden": torch.randn(ROWS, TEACHER_DIM, generator=gen),
               "teacher_head": torch.randn(VOCAB, TEACHER_DIM, generator=gen) * 0.4}
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    labels[::4] = IGNORE_INDEX
    return student, teacher, labels.to(KERNEL_DEVICE)


@pytest.mark.parametrize("ratio, temperature, dft, chunk", [(0.5, 1.0, False, 6), (0.3, 2.0, False, 1024),
                                                            (1.0, 0.7, False, 1), (0.6, 1.5, True, 6)],
                         ids=["half", "softened", "kl-alone", "dft"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_the_full_logit_loss_forward_and_backward(dtype, weighted, ratio, temperature, dft, chunk):
    """As the training step runs it: the student's hidden states and head in the run's dtype (the head GEMMs in it:
    fp32_loss false), the teacher's too, against float64 full logits of the same rounded values."""
    raw, teacher, labels = problem(int(ratio * 10) + chunk, weighted)
    rounded = {name: value.to(dtype) if name != "token_weights" else value for name, value in raw.items()}
    teacher = {name: value.to(dtype) for name, value in teacher.items()}
    grad = ("hidden", "head")
    fixed = {"labels": labels, "ratio": ratio, "temperature": temperature, "dft": dft}
    truth = run(lambda **t: reference(**t, **{k: v.to(KERNEL_DEVICE, torch.float64) for k, v in teacher.items()},
                                      **fixed),
                leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 2)
    loss = DistillationLoss(ratio, temperature, dft)

    def fast(hidden, head, token_weights=None):
        summed, count = loss(hidden, head, teacher["teacher_hidden"].to(KERNEL_DEVICE),
                             teacher["teacher_head"].to(KERNEL_DEVICE), labels, chunk, False, token_weights)
        assert count == int((labels != IGNORE_INDEX).sum())
        return summed
    got = run(fast, leaves(rounded, {}, KERNEL_DEVICE, grad), 2)
    assert got["out0"].dtype == torch.float32
    assert loss.last_backend == f"torch_chunked_linear_{'dft' if dft else 'ce'}_kl" + ("_weighted" if weighted else "")
    assert_matches(got, truth, dtype)
    assert not got["d_hidden"][::4].any()  # unsupervised rows: no loss, no gradient


def test_the_terms_are_the_cross_entropy_and_the_kl_and_make_the_loss():
    raw, teacher, labels = problem(5, weighted=True)
    loss = DistillationLoss(0.4, 2.0)
    summed, _ = loss(raw["hidden"], raw["head"], teacher["teacher_hidden"], teacher["teacher_head"], labels, 4, True,
                     raw["token_weights"])
    ce, kl = loss.last_terms.double()
    truth = {name: reference(raw["hidden"].double(), raw["head"].double(), raw["token_weights"].double(),
                             teacher_hidden=teacher["teacher_hidden"].double(),
                             teacher_head=teacher["teacher_head"].double(), labels=labels, ratio=ratio,
                             temperature=2.0) for name, ratio in (("ce", 0.0), ("kl", 1.0))}
    torch.testing.assert_close(ce, truth["ce"], rtol=1e-5, atol=0)
    torch.testing.assert_close(kl, truth["kl"] / 4, rtol=1e-5, atol=0)  # the KL itself: tau^2 is the loss's
    torch.testing.assert_close(summed.double(), 0.6 * ce + 0.4 * 4 * kl, rtol=1e-6, atol=0)
    assert not loss.last_terms.requires_grad


def test_at_temperature_1_the_kl_is_torchtune_s_forward_kl_loss_less_the_teacher_s_entropy():
    """torchtune's ForwardKLLoss sums -p log q, the teacher's cross-entropy against the student: the KL and the
    teacher's entropy, which takes no gradient."""
    raw, teacher, labels = problem(6, weighted=False)
    loss = DistillationLoss(1.0, 1.0)
    loss(raw["hidden"], raw["head"], teacher["teacher_hidden"], teacher["teacher_head"], labels, 4, True)
    supervised = labels != IGNORE_INDEX
    log_q = F.log_softmax((raw["hidden"] @ raw["head"].t())[supervised].double(), -1)
    log_p = F.log_softmax((teacher["teacher_hidden"] @ teacher["teacher_head"].t())[supervised].double(), -1)
    forward_kl_loss, entropy = -(log_p.exp() * log_q).sum(), -(log_p.exp() * log_p).sum()
    torch.testing.assert_close(loss.last_terms[1].double(), forward_kl_loss - entropy, rtol=1e-5, atol=0)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dft", [False, True], ids=["ce", "dft"])
def test_at_ratio_0_the_loss_and_its_gradients_are_the_chunked_cross_entropy_s_bit_for_bit(weighted, dft):
    """The KL is measured (last_terms) and adds nothing: a run at ratio 0 trains as a run without a teacher."""
    raw, teacher, labels = problem(7, weighted)
    found = {}
    for name in ("plain", "distilled"):
        hidden, head = raw["hidden"].clone().requires_grad_(), raw["head"].clone().requires_grad_()
        weights = raw.get("token_weights")
        if name == "plain":
            summed, _ = chunked_cross_entropy_sum(hidden, head, labels, 6, True, weights, dft=dft)
        else:
            loss = DistillationLoss(0.0, 2.0, dft)
            summed, _ = loss(hidden, head, teacher["teacher_hidden"], teacher["teacher_head"], labels, 6, True, weights)
            assert loss.last_terms[1] > 0
        summed.backward()
        found[name] = (summed.detach(), hidden.grad, head.grad)
    for plain, distilled in zip(found["plain"], found["distilled"]):
        assert torch.equal(plain, distilled)


def test_a_teacher_equal_to_its_student_adds_no_kl_and_no_gradient():
    raw, _, labels = problem(9, weighted=False)
    hidden, head = raw["hidden"].clone().requires_grad_(), raw["head"].clone().requires_grad_()
    loss = DistillationLoss(1.0, 3.0)
    summed, _ = loss(hidden, head, raw["hidden"], raw["head"], labels, 5, True)
    summed.backward()
    assert abs(float(summed.detach())) < 1e-4 and float(loss.last_terms[1]) < 1e-6
    assert hidden.grad.abs().max() < 1e-5 and head.grad.abs().max() < 1e-5


def test_a_frozen_head_and_a_batch_without_supervision():
    raw, teacher, labels = problem(11, weighted=False)
    head = raw["head"].clone()  # LoRA's frozen base: no gradient buffer kept, hidden's gradient as before
    hidden = raw["hidden"].clone().requires_grad_()
    summed, _ = DistillationLoss(0.5, 1.0)(hidden, head, teacher["teacher_hidden"], teacher["teacher_head"], labels,
                                           6, True)
    assert summed.grad_fn.saved_tensors[1] is None
    summed.backward()
    assert hidden.grad is not None and head.grad is None
    loss = DistillationLoss(0.5, 1.0)
    nothing, count = loss(raw["hidden"].requires_grad_(), raw["head"], teacher["teacher_hidden"],
                          teacher["teacher_head"], torch.full_like(labels, IGNORE_INDEX), 6, True)
    assert count == 0 and float(nothing.detach()) == 0.0 and loss.last_terms.tolist() == [0.0, 0.0]


def test_a_teacher_of_another_vocabulary_and_bad_settings_are_refused():
    raw, teacher, labels = problem(13, weighted=False)
    with pytest.raises(ValueError, match="teacher's vocabulary has 299 tokens, the student's 300"):
        DistillationLoss(0.5, 1.0)(raw["hidden"], raw["head"], teacher["teacher_hidden"], teacher["teacher_head"][1:],
                                   labels, 6, True)
    for ratio, temperature in ((1.5, 1.0), (-0.1, 1.0), (0.5, 0.0)):
        with pytest.raises(ValueError, match="ratio in \\[0, 1\\] and a positive temperature"):
            DistillationLoss(ratio, temperature)
