"""Render the results table the README and the docs show, from the records in ``benchmarks/results/``.

``python -m benchmarks.render [--bench sync]`` prints the table (the newest headline record of each benchmark
and CPU kind; a record named with a suffix after its date, like ``-delta`` or ``-pull``, is a variant and
stays out). ``--write FILE...`` replaces the table between ``<!-- results:SELECTION -->`` and
``<!-- /results -->`` in each file (SELECTION: ``all`` or a benchmark's name); ``--check FILE...`` exits 1
where a file's table differs from what the records give.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .records import RESULTS, load_records

Row = tuple[str, float | None, float | None, Any]  # label, ours, baseline, bit for bit
HEADLINE = re.compile(
    r"^(?P<bench>[a-z]+)-(?P<cpu>avx2|avx512|amx)-(?P<date>\d{4}-\d\d-\d\d)(?:[a-z]|-\d+)?$"
)
CPUS = {"avx2": "AVX2", "avx512": "AVX-512", "amx": "AMX"}
BLOCK = re.compile(r"(<!-- results:(?P<sel>[a-z]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def _figures(record: dict[str, Any]) -> dict[str, Any]:
    figures = record["figures"]
    return figures["runs"][-1] if "runs" in figures else figures


def _sync(f: dict[str, Any]) -> Iterator[Row]:
    for r in f["rows"]:
        yield f"{r['trainer']} → vLLM TP 2, over gloo", r["ours_s"], r["baseline_s"], r.get("bitwise_equal")
        if r.get("ours_same_host_s"):
            yield (
                f"{r['trainer']} → vLLM TP 2, same host",
                r["ours_same_host_s"],
                r["baseline_s"],
                r.get("bitwise_equal"),
            )


def _hosts(f: dict[str, Any]) -> Iterator[Row]:
    for r in f["rows"]:
        link = f"{r['rate_bps'] / 1e9:g} Gbit/s" if r.get("rate_bps") else "unshaped veth"
        yield (
            f"zero3 → TP 2 on another host, {link}",
            r["ours_s"],
            r.get("baseline_s"),
            r.get("bitwise_equal"),
        )
        if r.get("ours_pull_s"):
            yield (
                f"the same over NIXL, {link}",
                r["ours_pull_s"],
                r.get("baseline_s"),
                r.get("pull_bitwise_equal"),
            )


def _lora(f: dict[str, Any]) -> Iterator[Row]:
    for r in f["rows"]:
        how = " (fully_sharded_loras)" if r.get("fully_sharded_loras") else ""
        yield f"LoRA {r['mode']}{how}", r["ours_s"], r["baseline_s"], r.get("equal")


def _trl(f: dict[str, Any]) -> Iterator[Row]:
    for r in f["rows"]:
        yield f"TRL GRPO {r['mode']}, ZeRO-{r['zero']}", r["ours_s"], r["trl_s"], r.get("bitwise_equal")


def _inflight(f: dict[str, Any]) -> Iterator[Row]:
    for r in f["rows"]:
        yield (
            f"in-flight stall, {r['requests']} requests (keep vs drain)",
            r["stall_keep_s"],
            r["stall_wait_s"],
            r.get("bitwise_equal"),
        )


def _execute(f: dict[str, Any]) -> Iterator[Row]:
    yield f"executor only, {f['bytes'] / 2**20:.0f} MiB over gloo", f["ours_s"], f["baseline_s"], None


def _setup(f: dict[str, Any]) -> Iterator[Row]:
    yield "setup: target maps (vs element probe)", f["fast_s"], f["full_s"], f.get("maps_equal")


def _plan(f: dict[str, Any]) -> Iterator[Row]:
    for r in f["single"]:
        if r["pieces"] == 1024:
            yield "planning [8192, 8192] at 1,024 pieces (vs DeepSpeed)", r["ours_s"], r["deepspeed_s"], None


ROWS: dict[str, Callable[[dict[str, Any]], Iterator[Row]]] = {
    "sync": _sync,
    "hosts": _hosts,
    "lora": _lora,
    "trl": _trl,
    "inflight": _inflight,
    "execute": _execute,
    "setup": _setup,
    "plan": _plan,
}
BASELINES = {
    "sync": "OpenRLHF-style gather + broadcast + `load_weights`",
    "hosts": "the same baseline across the link",
    "lora": "TRL's PEFT sync (gather, merge, push, unmerge)",
    "trl": "TRL's own `sync_weights`",
    "inflight": "`pause(mode=wait)`: drain, then sync",
    "execute": "gather + broadcast",
    "setup": "element probe",
    "plan": "DeepSpeed `plan_transfer`",
}


def headline(
    records: dict[str, dict[str, Any]], bench: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The newest headline record of each benchmark and CPU kind, in ``ROWS`` order, then AVX2, AVX-512, AMX."""
    newest: dict[tuple[str, str], tuple[str, str]] = {}
    for stem in records:
        m = HEADLINE.match(stem)
        if m is None or m["bench"] not in ROWS or (bench is not None and m["bench"] != bench):
            continue
        key = (m["bench"], m["cpu"])
        if key not in newest or (m["date"], stem) > newest[key]:
            newest[key] = (m["date"], stem)
    order = {name: i for i, name in enumerate(ROWS)}
    cpus = list(CPUS)
    keys = sorted(newest, key=lambda k: (order[k[0]], cpus.index(k[1])))
    return [(newest[k][1], records[newest[k][1]]) for k in keys]


def _seconds(s: float | None) -> str:
    return "—" if s is None else f"{s:.3g} s"


def table(records: dict[str, dict[str, Any]], bench: str | None = None) -> str:
    lines = [
        "| what | against | CPU (2 cores), date | rollout-sync | baseline | × | bit for bit | record |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stem, record in headline(records, bench):
        name = record["bench"]
        for label, ours, base, equal in ROWS[name](_figures(record)):
            ratio = f"{base / ours:.1f}×" if ours and base else "—"
            same = {True: "yes", False: "**no**", None: "—"}[equal]
            lines.append(
                f"| {label} | {BASELINES[name]} | {CPUS[record['machine']['cpu']]}, {record['date']} | "
                f"**{_seconds(ours)}** | {_seconds(base)} | {ratio} | {same} | `{stem}` |"
            )
    return "\n".join(lines) + "\n"


def replace_tables(text: str, records: dict[str, dict[str, Any]]) -> str:
    def one(m: re.Match[str]) -> str:
        sel = m["sel"]
        return m.group(1) + table(records, None if sel == "all" else sel) + m.group(4)

    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__.split("\n")[0])
    parser.add_argument("--bench", default=None, help="one benchmark's rows only")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--write", nargs="+", type=Path, default=[])
    parser.add_argument("--check", nargs="+", type=Path, default=[])
    args = parser.parse_args(argv)
    records = load_records(args.results)
    if not args.write and not args.check:
        sys.stdout.write(table(records, args.bench))
        return 0
    stale = []
    for path in [*args.write, *args.check]:
        text = path.read_text()
        if not BLOCK.search(text):
            print(f"{path}: no <!-- results:... --> block", file=sys.stderr)
            return 1
        new = replace_tables(text, records)
        if path in args.write:
            path.write_text(new)
        elif new != text:
            stale.append(str(path))
    if stale:
        print(f"stale results tables (run python -m benchmarks.render --write): {stale}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
