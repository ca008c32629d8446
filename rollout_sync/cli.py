"""The ``rollout-sync`` command.

``rollout-sync plan``: a dry run of a whole sync on one CPU, from shapes alone (see ``PLAN_HELP`` and
``rollout_sync.scale``). Each replica policy runs in a fresh child process, so that the peak memory and
timings of one do not include the other's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .errors import RolloutSyncError
from .scale.dry_run import DEFAULT_STAGING_CAP_BYTES, POLICIES, DryRunConfig
from .scale.report import format_report, json_line
from .scale.spec import check_fit, load_model, parse_rollout, parse_trainer
from .scale.sync_model import GPU_LINKS
from .scale.traffic import DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS, Bandwidth

__all__ = ["main"]

PLAN_HELP = f"""\
Dry-run a whole sync on one CPU, before anyone spends a GPU-hour: build every rank's maps from the model's
shapes alone (the builders the live DeepSpeed and vLLM adapters are tested against), plan the whole sync,
and report its size, its cost to plan, and what it would take on the wire.

Global ranks: trainer GPUs 0..T-1 (DeepSpeed's numbering: TP groups are consecutive ranks, AutoEP groups
consecutive ranks too), then rollout GPUs T.. engine by engine.

Reported: pieces per side, segments, plan bytes per rank (its half's records), bytes sent per trainer GPU
and received per rollout GPU (max, mean), executor rounds of the busiest sender and receiver at the staging
cap, planning seconds (CPU seconds of one core) and peak memory, the time for one rank to plan only its own
half (the slowest of a sample of trainer and rollout ranks), and the modeled sync time next to its lower
bound. Both replica policies are run, each in a fresh process; --policy picks the one the JSON line gives.

Replica policies (which holder of a replicated source box sends it; only ZeRO-0/1/2 and AutoTP-replicated
tensors have several holders):
  lowest    the lowest holder rank (DeepSpeed's default);
  balanced  policy.Spread: the holder at (base-n digit sum of the target rank + crc32(tensor)) mod n,
            which spreads an engine's TP ranks over the holders and needs no state, so each rank can
            plan its own half alone and gets the same choices as the whole plan.

Time model: every GPU has, per direction, one intra-node link (--intra-gbps, default
{DEFAULT_INTRA_GBPS:g} GB/s: NVLink4 NCCL bus bandwidth) and one inter-node link (--inter-gbps, default
{DEFAULT_INTER_GBPS:g} GB/s: a 400 Gb/s NIC per GPU), all at full rate at once:
  time(GPU) = max(sent_intra/intra, sent_inter/inter, received_intra/intra, received_inter/inter)
  modeled   = max over GPUs of time(GPU)
Trainer and rollout GPUs sit on separate nodes (--trainer/--rollout gpus_per_node, default 8), unless
--shared-nodes puts rollout GPU j on the node of trainer GPU j. Bytes are the source dtype's (the wire's).
Lower bound: the most bytes any rollout GPU must receive, divided by its ingress bandwidth (the NIC; plus
NVLink when trainer GPUs share its node). The modeled sync adds to that wire time what the busiest sender
and receiver spend besides the wire, from the executor's own schedule of them (scale/sync_model.py): the
agreement (--agree-ms), each message (--message-us per message and end) and their pack/unpack and local
copies (--copy-gbps). The GPU defaults are assumptions (the GPU path has not run); on CPU the same model is
checked against real syncs with measured figures by `python -m benchmarks model`. Congestion in the
fabric is not modeled.

Layouts:
  --trainer "zero=3,tp=1,ep=64,world=256[,gpus_per_node=8]"   data-parallel size = world / tp
  --rollout "engines=8,tp=16[,ep=16][,gpus_per_node=8]"        ep is 1 (experts split by TP) or tp

Example:
  rollout-sync plan --model kimi-k2 --trainer "zero=3,tp=1,ep=64,world=256" \\
      --rollout "engines=8,tp=16,ep=16,gpus_per_node=8" --json --plot traffic.png
"""


def _bytes(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
    raw = text.strip().lower()
    digits = raw.rstrip("kmgib")
    unit = raw[len(digits) :]
    if not digits.isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 67108864, 64MiB, 1GiB)")
    value = int(digits) * units[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-sync", description="rollout-sync tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser(
        "plan",
        help="dry-run the plan of a whole sync from shapes alone",
        description=PLAN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "--model", required=True, help="a preset (qwen3-8b, qwen3-30b-a3b, ...) or a config.json path"
    )
    plan.add_argument("--trainer", required=True, help='e.g. "zero=3,tp=1,ep=64,world=256"')
    plan.add_argument("--rollout", required=True, help='e.g. "engines=8,tp=16,ep=16,gpus_per_node=8"')
    plan.add_argument("--policy", choices=POLICIES, default="balanced", help="policy of the JSON line")
    plan.add_argument(
        "--cap", type=_bytes, default=DEFAULT_STAGING_CAP_BYTES, help="staging cap per rank (default 64MiB)"
    )
    plan.add_argument("--intra-gbps", type=_positive, default=DEFAULT_INTRA_GBPS, help="NVLink GB/s per GPU")
    plan.add_argument("--inter-gbps", type=_positive, default=DEFAULT_INTER_GBPS, help="NIC GB/s per GPU")
    plan.add_argument("--shared-nodes", action="store_true", help="rollout GPU j on trainer GPU j's node")
    plan.add_argument(
        "--message-us",
        type=_positive,
        default=GPU_LINKS.message_s * 1e6,
        help="seconds per message and end, in us",
    )
    plan.add_argument(
        "--copy-gbps", type=_positive, default=GPU_LINKS.copy_gbps, help="pack/unpack copy GB/s per GPU"
    )
    plan.add_argument("--agree-ms", type=_positive, default=GPU_LINKS.agree_s * 1e3, help="agreement, ms")
    plan.add_argument("--dtype", default="bfloat16", help="storage dtype of both sides (default bfloat16)")
    plan.add_argument("--only", action="store_true", help="run --policy only, not both policies")
    plan.add_argument("--no-rounds", action="store_true", help="skip the executor schedule of busy ranks")
    plan.add_argument(
        "--in-process", action="store_true", help="run in this process (no fresh process per policy)"
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    plan.add_argument("--plot", metavar="FILE.png", help="write per-rank bytes sent and received")
    return parser


class _ChildBug(Exception):
    """An unexpected exception in a dry-run child process; its text is the child's traceback."""


def _child(config: DryRunConfig, conn: Any) -> None:
    from .scale.dry_run import dry_run

    try:
        conn.send(("ok", dry_run(config)))
    except RolloutSyncError as exc:
        conn.send(("error", str(exc)))
    except Exception:  # a bug, not a bad layout: the parent shows the whole traceback
        conn.send(("bug", traceback.format_exc()))
    finally:
        conn.close()


def _run(config: DryRunConfig, in_process: bool) -> dict[str, Any]:
    if in_process:
        from .scale.dry_run import dry_run

        return dry_run(config)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(config, child), name=f"rollout-sync-plan-{config.policy}")
    proc.start()
    child.close()
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join()
        raise RolloutSyncError(
            f"the dry run of policy {config.policy!r} died (exit code {proc.exitcode}; out of memory?)"
        ) from None
    proc.join()
    if status == "bug":
        raise _ChildBug(str(payload))
    if status != "ok":
        raise RolloutSyncError(str(payload))
    result: dict[str, Any] = payload
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        trainer = parse_trainer(args.trainer)
        rollout = parse_rollout(args.rollout)
        _, model = load_model(args.model)
        check_fit(model, trainer, rollout)
        bandwidth = Bandwidth(args.intra_gbps * 1e9, args.inter_gbps * 1e9)
        policies = [args.policy] if args.only else sorted(POLICIES, key=lambda p: p != args.policy)
        results = []
        for policy in policies:
            config = DryRunConfig(
                args.model,
                trainer,
                rollout,
                policy,
                args.cap,
                bandwidth,
                args.shared_nodes,
                args.dtype,
                rounds=not args.no_rounds,
                links=replace(
                    GPU_LINKS,
                    message_s=args.message_us * 1e-6,
                    copy_gbps=args.copy_gbps,
                    agree_s=args.agree_ms * 1e-3,
                ),
            )
            results.append(_run(config, args.in_process))
        print(format_report(results))
        if args.plot:
            from .scale.plot import plot_traffic

            print(f"plot: {plot_traffic(results, args.plot)}")
        if args.json:
            print(json_line(results[0], results[1:]))
    except RolloutSyncError as exc:
        print(f"rollout-sync plan: error: {exc}", file=sys.stderr)
        return 2
    except _ChildBug as bug:
        print(f"rollout-sync plan: internal error in a dry-run process:\n{bug}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
