"""Full-shard two-dimensional loss weighting: groups of cells, each with a target share of the loss.

`loss_groups` maps a group to its `target_share`, its `tasks` (cells) and each
cell's share within the group (`task_target_shares`). A cell is a task (the
`task` field of examples.jsonl), or `task x domain`, where domain is the
example's `domain` field (or its `group` field when it has no `domain`, as in
the embedded data). At start-up the supervised labels visible in the context
window are counted per cell over the whole train partition, and every token
of a cell gets the coefficient

    group target_share x cell share / raw token share of the cell

so that the cells' shares of the weighted token mass are the targets. The
loss is normalised by the weighted mass, every example is still consumed and
no forward pass changes. A coefficient above `max_task_loss_weight` (a very
sparse cell pushed to a large share: high gradient variance) stops the run
before the first optimizer step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cflib.errors import ParamError

CELL_SEPARATOR = " x "
SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class CellTarget:
    group: str
    cell: str
    group_share: float
    cell_share: float

    @property
    def target(self) -> float:
        return self.group_share * self.cell_share


def _share(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ParamError(f"loss_groups: {where} must be a number in (0, 1], got {value!r}")
    return float(value)


def parse_loss_groups(loss_groups: Any) -> list[CellTarget]:
    """Every cell with its group's and its own target; shares sum to one per level, each cell once."""
    if not isinstance(loss_groups, dict) or not loss_groups:
        raise ParamError(f"loss_groups must be a non-empty mapping of group -> {{target_share, tasks, "
                         f"task_target_shares}}, got {loss_groups!r}")
    cells: list[CellTarget] = []
    owner: dict[str, str] = {}
    group_total = 0.0
    for group, spec in loss_groups.items():
        if not isinstance(spec, dict):
            raise ParamError(f"loss_groups: group {group!r} must be a mapping, got {spec!r}")
        unknown = sorted(set(spec) - {"target_share", "tasks", "task_target_shares"})
        if unknown:
            raise ParamError(f"loss_groups: group {group!r} has unknown key(s) {unknown}; "
                             "expected target_share, tasks, task_target_shares")
        group_share = _share(spec.get("target_share"), f"group {group!r} target_share")
        group_total += group_share
        tasks, shares = spec.get("tasks"), spec.get("task_target_shares")
        if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) and t for t in tasks):
            raise ParamError(f"loss_groups: group {group!r} needs a non-empty list of task names 'tasks'")
        if not isinstance(shares, dict):
            raise ParamError(f"loss_groups: group {group!r} needs task_target_shares (cell -> share)")
        for cell in tasks:
            if cell in owner:
                where = "twice in its tasks" if owner[cell] == group else f"in groups {owner[cell]!r} and {group!r}"
                raise ParamError(f"loss_groups: cell {cell!r} appears {where}; every cell appears exactly once")
            owner[cell] = group
        missing = [cell for cell in tasks if cell not in shares]
        extra = [cell for cell in shares if cell not in tasks]
        if missing or extra:
            raise ParamError(f"loss_groups: group {group!r}: task_target_shares must name exactly its tasks "
                             f"(missing {missing}, not in tasks {extra})")
        total = sum(_share(shares[cell], f"group {group!r} share of {cell!r}") for cell in tasks)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise ParamError(f"loss_groups: group {group!r}: task_target_shares sum to {total:g}, not 1")
        cells += [CellTarget(group, cell, group_share, float(shares[cell])) for cell in tasks]
    if abs(group_total - 1.0) > SHARE_TOLERANCE:
        raise ParamError(f"loss_groups: the groups' target_share values sum to {group_total:g}, not 1")
    for cell in owner:  # a task is weighted whole or by domain, never both
        task = cell.split(CELL_SEPARATOR)[0]
        if CELL_SEPARATOR in cell and task in owner:
            raise ParamError(f"loss_groups: cell {cell!r} overlaps cell {task!r}: weight a task whole or by "
                             "domain, not both")
    return cells


def cell_of(row: dict, configured: set[str]) -> str | None:
    """The configured cell an examples.jsonl row falls in, if any."""
    task = str(row.get("task", ""))
    domain = row.get("domain", row.get("group"))
    by_domain = f"{task}{CELL_SEPARATOR}{domain}"
    if domain is not None and by_domain in configured:
        return by_domain
    return task if task in configured else None


@dataclass
class LossWeights:
    """The coefficient of every cell and the cell of every train example."""

    cells: list[CellTarget]
    example_cell: np.ndarray  # [examples] index into cells
    visible_tokens: np.ndarray  # [cells] supervised labels within the window, over the partition
    coefficients: np.ndarray  # [cells]
    max_task_loss_weight: float

    def example_weights(self) -> np.ndarray:
        return self.coefficients[self.example_cell]

    def cell_mass(self, examples: np.ndarray, supervised_counts: np.ndarray) -> np.ndarray:
        """Weighted token mass per cell of some examples (repeats counted)."""
        return np.bincount(self.example_cell[examples], weights=self.coefficients[self.example_cell[examples]]
                           * supervised_counts[examples], minlength=len(self.cells))

    def audit(self, trained_mass: np.ndarray | None = None) -> list[dict]:
        """One row per cell: raw share, targets, coefficient, achieved share (and share actually trained)."""
        raw = self.visible_tokens / self.visible_tokens.sum()
        weighted = self.coefficients * self.visible_tokens
        rows = []
        for index, cell in enumerate(self.cells):
            row = {"group": cell.group, "cell": cell.cell, "examples": int((self.example_cell == index).sum()),
                   "visible_tokens": int(self.visible_tokens[index]), "raw_share": float(raw[index]),
                   "group_target": cell.group_share, "cell_target": cell.cell_share, "target_share": cell.target,
                   "coefficient": float(self.coefficients[index]),
                   "achieved_share": float(weighted[index] / weighted.sum())}
            if trained_mass is not None and trained_mass.sum() > 0:
                row["trained_share"] = float(trained_mass[index] / trained_mass.sum())
            rows.append(row)
        return rows


def derive_loss_weights(loss_groups: dict, rows: Sequence[dict], visible_tokens: np.ndarray,
                        max_task_loss_weight: float, data: str = "the train data") -> LossWeights:
    """Coefficients from the train partition's rows and the visible supervised labels of each example; `data`
    says in errors which examples these are (those filters kept, say)."""
    cells = parse_loss_groups(loss_groups)
    index_of = {cell.cell: index for index, cell in enumerate(cells)}
    example_cell = np.empty(len(rows), dtype=np.int64)
    uncovered: dict[tuple, list] = {}
    for example, row in enumerate(rows):
        cell = cell_of(row, set(index_of))
        if cell is None:
            key = (row.get("task"), row.get("domain", row.get("group")))
            uncovered.setdefault(key, []).append(row.get("example_id", example))
            continue
        example_cell[example] = index_of[cell]
    if uncovered:
        (task, domain), ids = next(iter(uncovered.items()))
        raise ParamError(f"loss_groups: {sum(len(v) for v in uncovered.values())} train examples fall in no cell, "
                         f"e.g. {len(ids)} of task {task!r} (domain {domain!r}, first {ids[0]!r}); add "
                         f"{task!r} or '{task}{CELL_SEPARATOR}{domain}' to a group (cells missing: "
                         f"{sorted(str(t) for t, _ in uncovered)})")
    tokens = np.bincount(example_cell, weights=visible_tokens, minlength=len(cells))
    empty = [cells[i].cell for i in np.flatnonzero(tokens == 0)]
    if empty:
        raise ParamError(f"loss_groups: cell(s) {empty} have no visible supervised token in {data}; "
                         "they cannot reach a target share (remove them or fix their task names)")
    raw = tokens / tokens.sum()
    coefficients = np.array([cell.target for cell in cells]) / raw
    worst = int(np.argmax(coefficients))
    if not math.isfinite(max_task_loss_weight) or coefficients[worst] > max_task_loss_weight:
        cell = cells[worst]
        raise ParamError(f"loss_groups: cell {cell.cell!r} (group {cell.group!r}) would get loss coefficient "
                         f"{coefficients[worst]:.2f} = {cell.group_share:g} x {cell.cell_share:g} / raw share "
                         f"{raw[worst]:.4f}, above max_task_loss_weight {max_task_loss_weight:g}: so sparse a cell "
                         "pushed to that share makes gradients noisy; lower its target or raise the cap")
    return LossWeights(cells, example_cell, tokens, coefficients, max_task_loss_weight)


def audit_table(rows: list[dict]) -> str:
    """The audit as a markdown table."""
    trained = any("trained_share" in row for row in rows)
    header = "| group | cell | examples | raw share | group target | cell target | target | coefficient | achieved |"
    lines = [header + (" trained |" if trained else ""),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if trained else "")]
    for row in rows:
        line = (f"| {row['group']} | {row['cell']} | {row['examples']:,} | {row['raw_share']:.4f} | "
                f"{row['group_target']:.3f} | {row['cell_target']:.3f} | {row['target_share']:.4f} | "
                f"{row['coefficient']:.3f} | {row['achieved_share']:.4f} |")
        if trained:
            line += f" {row['trained_share']:.4f} |" if "trained_share" in row else " - |"
        lines.append(line)
    return "\n".join(lines)
