"""The ratios a throughput record is judged by, from the entries of one run."""
from __future__ import annotations

# Issue 4's targets for the production profile (ratios measured in one run).
TARGETS = (
    ("tokens_per_s", "production", "peer_liger", ">=", 1.25),
    ("tokens_per_s", "production", "best_peer", ">=", 1.25),
    ("tokens_per_s", "production", "reference", ">=", 2.5),
    ("peak_memory_gib", "production", "peer_liger", "<=", 0.8),
    ("best_tokens_per_s", "production", "best_peer", ">=", 1.25),
)


def _ok(entries: list[dict], path: str | None = None, micro: int | None = None) -> list[dict]:
    return [e for e in entries if e["status"] == "ok" and path in (None, e["path"])
            and micro in (None, e["micro_batch"])]


def _side(entries: list[dict], side: str, micro: int | None) -> tuple[dict | None, str]:
    """The entry standing for one side of a ratio: a named path, or the fastest peer; at `micro` or its best."""
    pool = [e for e in _ok(entries, micro=micro)
            if (e["path"].startswith("peer_") if side == "best_peer" else e["path"] == side)]
    if not pool:
        why = [f"{e['path']} mb{e['micro_batch']}: {e['status']} ({e.get('reason', '')})" for e in entries
               if (e["path"].startswith("peer_") if side == "best_peer" else e["path"] == side)
               and micro in (None, e["micro_batch"])]
        return None, f"{side} has no measurement" + (f": {'; '.join(why)}" if why else " (not in paths)")
    return max(pool, key=lambda e: e["tokens_per_s"]), ""


def compare(entries: list[dict], compare_micro: int) -> list[dict]:
    """Issue 4's ratios, from this run's entries; a side that did not run leaves its ratio None, saying why."""
    rows = []
    for quantity, top, bottom, sense, target in TARGETS:
        best = quantity == "best_tokens_per_s"
        micro = None if best else compare_micro
        field = "tokens_per_s" if best else quantity
        (num, why_num), (den, why_den) = _side(entries, top, micro), _side(entries, bottom, micro)
        row = {"quantity": field, "micro_batch": "best" if best else compare_micro, "numerator": top,
               "denominator": bottom, "target": f"{sense} {target}", "value": None, "met": None}
        if num is None or den is None or num.get(field) is None or den.get(field) is None:
            row["why_none"] = why_num or why_den or f"{field} not measured on this device"
        else:
            row["value"] = num[field] / den[field]
            row["met"] = row["value"] >= target if sense == ">=" else row["value"] <= target
            row["numerator_entry"] = f"{num['path']} mb{num['micro_batch']}"
            row["denominator_entry"] = f"{den['path']} mb{den['micro_batch']}"
        rows.append(row)
    return rows
