"""The product's throughput targets, and the ratios a record is judged by, taken from the entries of one run."""
from __future__ import annotations

from dataclasses import dataclass

RANDOM_ROWS, REALISTIC = "random_rows", "realistic"


@dataclass(frozen=True)
class Side:
    """One side of a ratio: a path (or "best_peer": the fastest peer measured in the same run on that kind of
    batches, at that micro-batch; "ceiling": the bf16 matmul ceiling), on one kind of batches, at the compared
    micro-batch or at the side's fastest ("best")."""

    path: str
    batches: str = RANDOM_ROWS
    micro: str = "compare"


@dataclass(frozen=True)
class Target:
    quantity: str  # the entry field compared
    numerator: Side
    denominator: Side
    sense: str  # ">=" or "<="
    value: float


# The product's floors, each against the fastest peer of the run: on random rows every peer path (Liger with SDPA
# or FlashAttention-4, torch.compile of the whole model or of the decoder body with Liger's loss); on realistic
# lengths every fed peer (padded, packed, padding-free, and padding-free under torch.compile).
TARGETS = (
    Target("tokens_per_s", Side("production"), Side("best_peer"), ">=", 1.30),
    Target("peak_memory_gib", Side("production"), Side("best_peer"), "<=", 0.90),
    Target("tokens_per_s", Side("production", micro="best"), Side("best_peer", micro="best"), ">=", 1.25),
    Target("supervised_tokens_per_s", Side("production", REALISTIC), Side("best_peer", REALISTIC), ">=", 1.30),
    Target("model_tflops_per_s", Side("production", micro="best"), Side("ceiling"), ">=", 0.60),
)
# LoRA on the production path against full-parameter training, when a run measures it.
LORA_TARGETS = tuple(
    target for path in ("production_lora", "production_lora_bf16_base") for target in (
        Target("tokens_per_s", Side(path), Side("production"), ">=", 0.90),
        Target("peak_memory_gib", Side(path), Side("production"), "<=", 1.00)))


def batches_of(entry: dict) -> str:
    return entry.get("batches", RANDOM_ROWS)  # records from before realistic lengths hold random rows only


def _ok(entries: list[dict], path: str | None = None, micro: int | None = None,
        batches: str | None = None) -> list[dict]:
    return [e for e in entries if e["status"] == "ok" and path in (None, e["path"])
            and micro in (None, e["micro_batch"]) and batches in (None, batches_of(e))]


def _is(entry: dict, side: Side) -> bool:
    if batches_of(entry) != side.batches:
        return False
    return entry["path"].startswith("peer_") if side.path == "best_peer" else entry["path"] == side.path


def _side(entries: list[dict], side: Side, compare_micro: int, quantity: str,
          ceiling: dict | None) -> tuple[dict | None, str]:
    """The entry standing for one side (the fastest of its pool), or None and why."""
    if side.path == "ceiling":
        if ceiling is None:
            return None, "no matmul ceiling in this record"
        return {"path": "ceiling", "micro_batch": "-", quantity: ceiling["tflops_per_s"]}, ""
    micro = compare_micro if side.micro == "compare" else None
    pool = [e for e in entries if _is(e, side) and micro in (None, e["micro_batch"])]
    ok = [e for e in pool if e["status"] == "ok"]
    if not ok:
        why = [f"{e['path']} mb{e['micro_batch']}: {e['status']} ({e.get('reason', '')})" for e in pool]
        return None, (f"{side.path} on {side.batches} has no measurement"
                      + (f": {'; '.join(why)}" if why else " (not in paths or batches)"))
    # The fastest: on realistic lengths by supervised tokens/s (a padded peer's tokens/s counts its padding).
    speed = "supervised_tokens_per_s" if side.batches == REALISTIC else "tokens_per_s"
    return max(ok, key=lambda e: e.get(speed) or 0.0), ""


def compare(entries: list[dict], compare_micro: int, ceiling: dict | None = None) -> list[dict]:
    """Every target's ratio from this run's entries; a side that did not run leaves its ratio None, saying why."""
    rows = []
    measured = {e["path"] for e in entries}
    for target in TARGETS + tuple(t for t in LORA_TARGETS if t.numerator.path in measured):
        top, bottom = target.numerator, target.denominator
        best = "best" in (top.micro, bottom.micro)
        row = {"quantity": target.quantity, "micro_batch": "best" if best else compare_micro,
               "numerator": top.path, "numerator_batches": top.batches,
               "denominator": bottom.path, "denominator_batches": bottom.batches,
               "target": f"{target.sense} {target.value:.2f}", "value": None, "met": None}
        denominator_field = "tflops_per_s" if bottom.path == "ceiling" else target.quantity
        (num, why_num) = _side(entries, top, compare_micro, target.quantity, ceiling)
        (den, why_den) = _side(entries, bottom, compare_micro, denominator_field, ceiling)
        if num is None or den is None or num.get(target.quantity) is None or den.get(denominator_field) is None:
            row["why_none"] = why_num or why_den or f"{target.quantity} not measured on this device"
        else:
            row["value"] = num[target.quantity] / den[denominator_field]
            row["met"] = row["value"] >= target.value if target.sense == ">=" else row["value"] <= target.value
            row["numerator_entry"] = f"{num['path']} mb{num['micro_batch']}"
            row["denominator_entry"] = ("bf16 matmul ceiling" if bottom.path == "ceiling"
                                        else f"{den['path']} mb{den['micro_batch']}")
        rows.append(row)
    return rows
