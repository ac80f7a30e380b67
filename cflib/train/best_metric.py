"""What makes one evaluation better than another: `best_metric`, and the answer metrics a run can name.

`best_metric` chooses the checkpoint a run keeps as `best/`, the one a curriculum stage hands to the next and
what early stopping watches. It names one number of an evaluation (cflib.train.trainer):

- `eval_loss`: the held-out loss (the default; lower is better);
- `exact_match`, or `exact_match/<task>`: greedy exact match over the held-out prompts, or one task's;
- `lm_eval/<task>/<metric>`: an lm-evaluation-harness score of the checkpoint (`eval_tasks_every`);
- a name `register_metric` added: a function of each generated answer and its reference, averaged over the
  held-out prompts (`<name>`, or `<name>/<task>` for one task's).

Whether greater is better is inferred (lower for losses and perplexities, higher otherwise; a registered
metric says) and `greater_is_better` overrides it. An evaluation that lacks the metric (a periodic one before
lm-eval ran, say) neither improves on the best nor counts against early stopping's patience.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cflib.errors import ParamError

DEFAULT = "eval_loss"
# A name with one of these parts reads as lower-is-better (lm-eval's perplexities, bits per byte, losses).
_LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte", "bpb")


@dataclass(frozen=True)
class AnswerMetric:
    """A score of one generated answer against its reference (both text), averaged over the held-out prompts."""

    score: Callable[[str, str], float]
    greater_is_better: bool = True


ANSWER_METRICS: dict[str, AnswerMetric] = {}


def register_metric(name: str, score: Callable[[str, str], float], greater_is_better: bool = True) -> None:
    """Make `best_metric: NAME` (and `NAME/<task>`) a run's choice: `score(answer, reference)` of each held-out
    prompt's greedy answer, as text, averaged. Registered in the process that trains (a notebook's cell before
    fit); torchrun's workers, processes of their own, register it again from its import path (cflib.train.registered):
    a function or class defined in a module they can import, an object bound to a name of such a module, or a
    regex_metric. One they cannot import (defined in a notebook cell, a closure) is refused where best_metric names
    it, and left out of their evaluations otherwise."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", name) or name in ("eval_loss", "exact_match", "lm_eval"):
        raise ValueError(f"register_metric: {name!r} must be a word of letters, digits, _ . - that is not "
                         "eval_loss, exact_match or lm_eval")
    if not callable(score):
        raise ValueError(f"register_metric {name!r}: score must be a function (answer, reference) -> float")
    ANSWER_METRICS[name] = AnswerMetric(score, greater_is_better)


class RegexMetric:
    """regex_metric's score: a class of the module holding its pattern, so that torchrun's workers, which cannot
    import an object by name unless it has one, rebuild it from the pattern (cflib.train.registered)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self._compiled = re.compile(pattern)

    def __call__(self, answer: str, reference: str) -> float:
        found, wanted = self._compiled.search(answer), self._compiled.search(reference)
        target = wanted.group(0) if wanted else reference
        return float(found is not None and found.group(0) == target)

    def __repr__(self) -> str:
        return f"regex_metric({self.pattern!r})"


def regex_metric(pattern: str) -> RegexMetric:
    """1.0 where the answer matches the pattern (re.search) and the match equals the reference's, else 0.0: the
    number after "answer:", say, whatever surrounds it. Carried to torchrun's workers by its pattern."""
    return RegexMetric(pattern)


def contains_metric(answer: str, reference: str) -> float:
    """1.0 where the answer contains the reference (stripped), else 0.0."""
    return float(reference.strip() in answer)


@dataclass(frozen=True)
class BestMetric:
    """best_metric resolved: its name, where an evaluation holds it and which way is better."""

    name: str
    greater_is_better: bool

    @property
    def needs_answers(self) -> bool:
        """Generated answers at every evaluation: exact match or a registered metric."""
        return self.name.split("/")[0] in ("exact_match", *ANSWER_METRICS)

    @property
    def lm_eval_task(self) -> str | None:
        return self.name.split("/")[1] if self.name.startswith("lm_eval/") else None

    def value(self, result: dict) -> float | None:
        """The metric in one evaluation (cflib.train.trainer's result), None where it was not computed."""
        if self.name == DEFAULT:
            return result.get("loss")
        head, _, rest = self.name.partition("/")
        if head == "exact_match":
            return (result.get("exact_match") or {}).get(rest or "overall")
        if head == "lm_eval":
            task, _, metric = rest.partition("/")
            return (result.get("lm_eval") or {}).get(task, {}).get(metric)
        return (result.get("metrics") or {}).get(self.name)

    def improves(self, value: float | None, best: float | None) -> bool:
        if value is None or not np.isfinite(value):
            return False
        if best is None:
            return True
        return value > best if self.greater_is_better else value < best

    def describe(self) -> dict:
        return {"name": self.name, "greater_is_better": self.greater_is_better}


def resolve_best_metric(name: str, greater_is_better: bool | None, eval_tasks: tuple[str, ...]) -> BestMetric:
    """best_metric checked against what the run computes; ParamError naming what is wrong, before step 1."""
    head, _, rest = name.partition("/")
    if name == DEFAULT:
        inferred = False
    elif head == "exact_match":
        inferred = True
    elif head == "lm_eval":
        task, _, metric = rest.partition("/")
        if not task or not metric:
            raise ParamError(f"best_metric {name!r}: an lm-eval score is named lm_eval/<task>/<metric>, "
                             "e.g. lm_eval/embedded_exact/exact_match")
        if task not in eval_tasks:
            raise ParamError(f"best_metric {name!r}: task {task!r} is not among eval_tasks "
                             f"({', '.join(eval_tasks) or 'none'}); add it, and set eval_tasks_every")
        inferred = not any(part in metric for part in _LOWER_IS_BETTER)
    elif head in ANSWER_METRICS:
        inferred = ANSWER_METRICS[head].greater_is_better
    else:
        raise ParamError(f"best_metric {name!r}: expected eval_loss, exact_match, exact_match/<task>, "
                         f"lm_eval/<task>/<metric> or a registered metric ({', '.join(ANSWER_METRICS) or 'none'}; "
                         "cflib.train.best_metric.register_metric adds one)")
    return BestMetric(name, inferred if greater_is_better is None else greater_is_better)


def answer_scores(texts: list[tuple[str, str, str]]) -> dict[str, float]:
    """Every registered metric over (task, answer, reference) texts: `<name>` overall and `<name>/<task>`."""
    scores: dict[str, float] = {}
    for name, metric in ANSWER_METRICS.items():
        per_task: dict[str, list[float]] = defaultdict(list)
        for task, answer, reference in texts:
            per_task[task].append(float(metric.score(answer, reference)))
        for task, values in sorted(per_task.items()):
            scores[f"{name}/{task}"] = float(np.mean(values))
        scores[name] = float(np.mean([v for values in per_task.values() for v in values])) if texts else 0.0
    return scores


EVAL_LOSS = BestMetric(DEFAULT, greater_is_better=False)


def evaluations_without_improvement(evals: list[dict], metric: BestMetric = EVAL_LOSS) -> int:
    """Trailing evaluations after training began whose metric did not beat the best before them (evaluations
    without the metric are passed over)."""
    best, since = None, 0
    for result in evals:
        value = metric.value(result)
        if result["step"] == 0 or value is None:
            continue
        best, since = (value, 0) if metric.improves(value, best) else (best, since + 1)
    return since
