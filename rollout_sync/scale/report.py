"""Dry-run results as text (one column per replica policy) and as one JSON line."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["JSON_KEYS", "format_report", "json_line"]

JSON_KEYS = (
    "plan_s",
    "rank_half_s",
    "peak_rss_bytes",
    "source_pieces",
    "target_pieces",
    "segments",
    "max_recv_bytes",
    "max_send_bytes",
    "modeled_s",
    "lower_bound_s",
)
"""The keys every JSON line carries first (the issue's contract); more follow."""

_EXTRA = (
    "model",
    "policy",
    "trainer",
    "rollout",
    "maps_s",
    "planner_s",
    "plan_wall_s",
    "rank_half_rank",
    "rank_half_objects_s",
    "halves_agree",
    "mean_send_bytes",
    "mean_recv_bytes",
    "max_half_bytes",
    "mean_half_bytes",
    "ratio",
    "wire_s",
    "overhead_s",
    "slowest_rank",
    "lower_bound_rank",
    "tensors",
    "params",
    "model_bytes",
    "intra_gbps",
    "inter_gbps",
    "shared_nodes",
    "staging_cap_bytes",
    "rounds",
)


def json_line(result: Mapping[str, Any], others: Sequence[Mapping[str, Any]] = ()) -> str:
    """One JSON object: the issue's keys first, then the other figures, then a short summary of the other
    policies' runs under ``"compare"``."""
    out = {k: result[k] for k in JSON_KEYS}
    out.update({k: result[k] for k in _EXTRA if k in result})
    if others:
        out["compare"] = {
            o["policy"]: {k: o[k] for k in (*JSON_KEYS, "ratio", "mean_send_bytes")} for o in others
        }
    return json.dumps(out, sort_keys=False, separators=(",", ":"))


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def _rounds(r: Mapping[str, Any]) -> str:
    rounds = r.get("rounds") or {}
    if not rounds:
        return "not computed"
    parts = []
    for role in ("sender", "receiver"):
        x = rounds.get(role)
        if x is None:
            continue
        if x["refused"]:
            parts.append(f"{role} {x['rank']}: refused ({x['refused']})")
        else:
            parts.append(
                f"{role} {x['rank']}: {x['rounds']} rounds, {x['messages']:,} messages of <= "
                f"{x['message_bytes'] / 1024:,.0f} KiB staged"
            )
    return "; ".join(parts)


def format_report(results: Sequence[Mapping[str, Any]]) -> str:
    """A table with one column per result (policy)."""
    first = results[0]
    lines = [
        f"model {first['model']}: {first['tensors']:,} logical tensors, {first['params'] / 1e9:,.1f} B"
        f" parameters, {_gb(first['model_bytes'])} ({first['dtype']})",
        f"trainer {first['trainer']}; rollout {first['rollout']}"
        f" ({'shared' if first['shared_nodes'] else 'separate'} nodes)",
        f"links per GPU: intra-node {first['intra_gbps']:g} GB/s, inter-node {first['inter_gbps']:g} GB/s;"
        f" staging cap {first['staging_cap_bytes'] / 2**20:g} MiB",
        "",
    ]
    rows: list[tuple[str, list[str]]] = [
        ("policy", [r["policy"] for r in results]),
        ("pieces: sources / targets", [f"{r['source_pieces']:,} / {r['target_pieces']:,}" for r in results]),
        ("segments", [f"{r['segments']:,}" for r in results]),
        (
            "plan: maps + planner (CPU s)",
            [f"{r['maps_s']:.3f} + {r['planner_s']:.3f} = {r['plan_s']:.3f}" for r in results],
        ),
        ("plan wall s (shared machine)", [f"{r['plan_wall_s']:.3f}" for r in results]),
        (
            "one rank's own half (CPU s)",
            [f"{r['rank_half_s']:.3f} (slowest: rank {r['rank_half_rank']})" for r in results],
        ),
        ("  as Segment objects (CPU s)", [f"{r['rank_half_objects_s']:.3f}" for r in results]),
        ("  halves agree with the plan", ["yes" if r["halves_agree"] else "NO" for r in results]),
        ("peak memory", [_mb(r["peak_rss_bytes"]) for r in results]),
        (
            "plan bytes per rank max / mean",
            [f"{_mb(r['max_half_bytes'])} / {_mb(r['mean_half_bytes'])}" for r in results],
        ),
        (
            "sent per trainer GPU max / mean",
            [f"{_gb(r['max_send_bytes'])} / {_gb(r['mean_send_bytes'])}" for r in results],
        ),
        (
            "received per rollout GPU max / mean",
            [f"{_gb(r['max_recv_bytes'])} / {_gb(r['mean_recv_bytes'])}" for r in results],
        ),
        (
            "modeled sync (wire + rest)",
            [
                f"{r['modeled_s']:.3f} s ({r['wire_s']:.3f} + {r['overhead_s']:.3f}; rank {r['slowest_rank']})"
                for r in results
            ],
        ),
        ("lower bound", [f"{r['lower_bound_s']:.3f} s (rank {r['lower_bound_rank']})" for r in results]),
        (
            "modeled / bound",
            [f"{r['ratio']:.3f}" if r["ratio"] is not None else "n/a" for r in results],
        ),
    ]
    label_width = max(len(k) for k, _ in rows)
    col = max(len(v) for _, vs in rows for v in vs)
    for label, values in rows:
        lines.append(f"{label:<{label_width}}  " + "  ".join(f"{v:<{col}}" for v in values).rstrip())
    for r in results:
        lines.append(f"rounds ({r['policy']}): {_rounds(r)}")
    return "\n".join(lines)
