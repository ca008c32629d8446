"""Sync across a host boundary with real engines: ours against the OpenRLHF-style baseline, over one shaped
link, in one run.

``python -m benchmarks hosts [--json] [--rates 1e9,2.5e9,0] [--syncs 2] [--warmup 1]
[--methods ours,pull,delta,baseline]``

Two emulated hosts (``testbed.hosts``: network, UTS, mount and PID namespaces, joined by a switch; needs
root): host a runs the trainer, DeepSpeed ZeRO-3 on 2 ranks (SGD, never stepped); host b runs one vLLM CPU
engine at TP 2 with ``testbed.baseline_extension.BenchExtension``. Model: Qwen3-0.6B's shapes, random bf16
weights (1.19 GB). The benchmark's driver stays outside both hosts and drives each side through a pool of
processes started on that host. Host b's link is shaped to each rate of ``--rates`` in turn (bits/s, ``tbf``,
both directions; ``0``: unshaped, the veth link's own speed); the engine is named by host a's hostname, as
DNS would resolve it on a cluster.

Per rate, every method runs ``--warmup`` unmeasured and ``--syncs`` measured syncs (medians), each after the
trainer's weights are negated in place (every byte new):

- ``ours``: ``TrainerSync.attach`` on the trainer ranks and ``rollout_sync_connect`` on the workers, with the
  coordinator at ``tcp://host-a:PORT`` (the one address a user names); each sync executes the plan (every
  byte crosses the link, once, to the worker that stores it), then ``reset_prefix_cache``;
- ``delta_rows``: the same after a handshake with ``delta=True``, at 1%, 10% and 50% of the stored weights
  changed (``bench sync``'s delta measurement: two unmeasured full syncs per fraction, then synthetic
  optimizer steps of that fraction; delta syncs, or full ones above ``delta_full_above``);
- ``pull`` (``ours_pull_s``): the same syncs after a handshake with ``backend="nixl"``: no process group;
  each vLLM worker reads its half straight from the trainer ranks' registered ZeRO-3 partitions through NIXL
  (UCX over TCP on the link); with ``delta`` too, ``ours_pull_delta_rows``: the delta rows again after a
  handshake with ``backend="nixl"`` and ``delta=True`` (each worker reads only what each trainer rank coded for
  it into its export, ``transport.nixl_delta``);
- ``baseline`` (OpenRLHF style): a gloo group of trainer rank 0 and every vLLM worker, its store on host a;
  per parameter ``GatheredParameters`` on every trainer rank, rank 0 broadcasts the full tensor across the
  link to every worker, each calls ``model.load_weights`` (inside vLLM's layerwise reload where vLLM packs
  its layers).

Each row: ``rate_bps`` (null: unshaped), ``link_measured_bps`` (one TCP stream from a to b just before),
``ours_s``, ``baseline_s``, ``bytes_across`` (what crossed into host b during one of ours' syncs, counted on
the link: payload and headers, median), ``baseline_bytes_across``, ``link_bound_s`` (``bytes_across`` over the
rate: the measured one where unshaped), ``delta_rows`` (``changed_fraction``, ``ours_delta_s``,
``delta_bytes_moved``, ``bitwise_equal``), ``modeled_s`` (``rollout_sync.scale.traffic.node_link_seconds``:
the plan's bytes into host b over the rate), ``bitwise_equal`` (after ours' syncs, the trainer's own
checkpoint written through vLLM's loader maps changes no bit of the engine), ``baseline_bitwise_equal``; with
``pull``: ``ours_pull_s``, ``pull_bytes_across``, ``ours_pull_over_link_bound``, ``pull_bitwise_equal``,
``ours_pull_delta_rows``. ``ours_rollout_phase_s`` and ``ours_pull_rollout_phase_s``: the slowest worker's
seconds by phase in the last measured sync (over the group: the executor's phases; over NIXL: ``ready``,
waiting for the trainer ranks, ``read``, waiting for reads, ``land``, copying staged parts into their
targets; both with the loaded forms' ``open_s`` and ``rebuild_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from testbed.rank_pool import RankContext

from .sync import (
    BUCKETS,
    MODEL_KIND,
    TOKEN,
    TP,
    TRAINER_ENV,
    TRAINERS,
    _check_bitwise,
    _measure,
    _measure_delta,
    _pack,
    baseline_connect,
    baseline_sync,
    detach,
    ours_sync,
    param_specs,
    start_engine,
    stop_engine,
)

__all__ = ["main"]

PORT = 29700
BASELINE_PORT = 29701
DEFAULT_RATES = (1e9, 2.5e9, 0.0)


def _log(msg: str) -> None:
    print(f"[bench hosts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- the engine, on host b


def engine_start(ctx: RankContext, model: str) -> float:
    start = time.perf_counter()
    ctx.state["llm"], ctx.state["pids"] = start_engine(Path(model))
    return time.perf_counter() - start


def engine_rpc(ctx: RankContext, method: str, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    return ctx.state["llm"].collective_rpc(method, args=tuple(args), kwargs=kwargs)


def engine_reset(ctx: RankContext) -> None:
    ctx.state["llm"].reset_prefix_cache()


def engine_stop(ctx: RankContext) -> list[int]:
    return stop_engine(ctx.state.pop("llm"), ctx.state.pop("pids"))


class EngineOnHost:
    """The vLLM engine in a pool's one rank, with the ``LLM`` methods the drivers call."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.pool.call(engine_rpc, method, list(args), kwargs)[0]

    def reset_prefix_cache(self) -> None:
        self.pool.call(engine_reset)


# ------------------------------------------------------------------------------- the trainer, on host a


def plan_bytes_into(ctx: RankContext) -> dict[int, int]:
    """Trainer rank 0: the plan's bytes into each rank from another node (trainers on node 0, workers on
    node 1)."""
    from rollout_sync.scale.traffic import Topology, plan_traffic

    plan = ctx.state["sync"].plan
    if plan is None:
        return {}
    return plan_traffic(plan, Topology(TRAINERS, TP, TRAINERS, TP)).recv_inter


# -------------------------------------------------------------------------------------------- the run


def link_speed(hosts: Any, mib: int = 256) -> float:
    """Bits/s of one TCP stream from host a to host b, now."""
    import subprocess

    server = (
        "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind(('0.0.0.0',5201));s.listen();print('listening',flush=True);c,_=s.accept()\n"
        "while c.recv(1<<20): pass\nc.sendall(b'k')"
    )
    client = (
        "import socket,sys,time\ns=socket.create_connection((sys.argv[1],5201),timeout=60);b=b'x'*(1<<20)\n"
        "t=time.perf_counter()\nfor _ in range(int(sys.argv[2])): s.sendall(b)\n"
        "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t)"
    )
    srv = hosts.run("b", [sys.executable, "-c", server], stdout=subprocess.PIPE)
    if srv.stdout.readline().strip() != b"listening":
        raise RuntimeError("the link test's server on host b did not start")
    seconds = float(
        hosts.exec("a", [sys.executable, "-c", client, hosts.address("b"), str(mib)], timeout=600)
    )
    srv.wait(30)
    return mib * 2**20 * 8 / seconds


def per_rate(
    hosts: Any, rates: Sequence[float], label: str, body: Callable[[float], dict[str, Any]]
) -> dict[float, dict[str, Any]]:
    out = {}
    for rate in rates:
        hosts.shape("b", rate_bps=int(rate) if rate else None)
        _log(f"{label} at {rate / 1e9:g} Gbit/s" if rate else f"{label} unshaped")
        out[rate] = body(rate)
    hosts.shape("b")
    return out


def run(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    from rollout_sync.scale.traffic import Topology, Traffic, node_link_seconds
    from testbed.deepspeed import DeepSpeedSpec
    from testbed.hosts import Hosts
    from testbed.rank_pool import RankPool
    from testbed.trainer_ranks import attach, setup
    from vllm_plugin.driver import setup_engines

    rates = [float(r) for r in args.rates.split(",")]
    cap = args.cap_mib * 2**20
    extra: dict[str, Any] = {"zero_allow_untested_optimizer": True, "zero_optimization": dict(BUCKETS)}
    spec = DeepSpeedSpec("dense-tied", zero_stage=3, optimizer="sgd", extra_config=extra)
    env_b = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1")}
    with Hosts(["a", "b"], shm_size="8g") as hosts:
        address = f"tcp://{hosts.name_of('a')}:{PORT}"
        timeout = args.timeout
        with (
            RankPool(
                1, env=env_b, timeout=timeout * 8, launcher=hosts.python_launcher("b"), daemon=False
            ) as on_b,
            RankPool(
                TRAINERS, env=TRAINER_ENV, timeout=timeout * 8, launcher=hosts.python_launcher("a")
            ) as on_a,
        ):
            _log(f"vLLM TP-{TP} engine on host b started in {on_b.call(engine_start, str(model))[0]:.1f} s")
            llm = EngineOnHost(on_b)
            try:
                _log(f"dense linear layers {_pack(llm, False)}")  # type: ignore[arg-type]
                started = time.perf_counter()
                setup_engines([llm], first_rank=TRAINERS)
                _log(f"target maps in {time.perf_counter() - started:.1f} s")
                on_a.call(setup, spec, str(model))
                _log("DeepSpeed ZeRO-3 on host a built")

                def handshake(delta: bool, backend: str = "gloo") -> None:
                    pending = on_a.submit(
                        attach, address, TOKEN, 1, None, "balanced", timeout, cap, True, delta, backend
                    )
                    llm.collective_rpc(
                        "rollout_sync_connect",
                        kwargs={"address": address, "engine": 0, "token": TOKEN, "timeout": timeout, "staging_cap_bytes": cap},
                    )  # fmt: skip
                    pending.result(timeout * 2)

                across: list[int] = []

                def counted(one: Callable[[int], Any]) -> Callable[[int], Any]:
                    def sync(i: int) -> Any:
                        before = hosts.bytes_into("b")
                        out = one(i)
                        across.append(hosts.bytes_into("b") - before)
                        return out

                    return sync

                def ours_once(i: int) -> Any:
                    pending = on_a.submit(ours_sync, i + 1)
                    w = llm.collective_rpc("rollout_sync_bench_receive")
                    return pending.result(timeout * 4), w

                handshake(delta=False)
                into = on_a.call(plan_bytes_into)[0]
                workdir = Path(args.workdir)

                def ours_at(rate: float) -> dict[str, Any]:
                    measured = link_speed(hosts)
                    across.clear()
                    summary, changed = _measure(
                        "ours", counted(ours_once), args.warmup, args.syncs, llm, on_a
                    )  # type: ignore[arg-type]
                    equal, _ = _check_bitwise(on_a, llm, workdir / "check-hosts-ours", model)  # type: ignore[arg-type]
                    return {
                        "measured": measured,
                        "summary": summary,
                        "across": int(statistics.median(across[args.warmup :])),
                        "equal": bool(equal and changed),
                    }

                ours = per_rate(hosts, rates, "ours", ours_at)
                pulls: dict[float, dict[str, Any]] = {}
                if "pull" in args.methods:
                    on_a.call(detach)
                    handshake(delta=False, backend="nixl")
                    pulls = per_rate(hosts, rates, "pull", ours_at)

                def delta_rows(backend: str, label: str) -> dict[float, dict[str, Any]]:
                    """The delta rows per rate, after a handshake with ``delta=True`` over ``backend``."""
                    on_a.call(detach)
                    handshake(delta=True, backend=backend)
                    return per_rate(
                        hosts,
                        rates,
                        f"{label} delta",
                        lambda rate: _measure_delta(
                            f"zero3-{label}", ours_once, args.warmup, args.syncs, llm, on_a, workdir, model
                        ),  # type: ignore[arg-type]
                    )

                deltas = delta_rows("gloo", "ours") if "delta" in args.methods else {}
                both = {"delta", "pull"} <= args.methods
                pull_deltas = delta_rows("nixl", "pull") if both else {}
                on_a.call(detach)
                baseline: dict[float, dict[str, Any]] = {}
                if "baseline" in args.methods:
                    world = 1 + TP
                    pending = on_a.submit(baseline_connect, hosts.address("a"), BASELINE_PORT, world, timeout)
                    llm.collective_rpc(
                        "openrlhf_baseline_connect",
                        args=(hosts.address("a"), BASELINE_PORT, world, 1, timeout),
                    )
                    pending.result(timeout * 2)
                    specs = on_a.call(param_specs)[0]

                    def baseline_once(i: int) -> Any:
                        pending = on_a.submit(baseline_sync)
                        w = llm.collective_rpc("openrlhf_baseline_receive", args=(specs,))
                        return pending.result(timeout * 8), w

                    def baseline_at(rate: float) -> dict[str, Any]:
                        across.clear()
                        summary, changed = _measure(
                            "baseline", counted(baseline_once), args.warmup, args.syncs, llm, on_a
                        )  # type: ignore[arg-type]
                        equal, _ = _check_bitwise(on_a, llm, workdir / "check-hosts-baseline", model)  # type: ignore[arg-type]
                        return {"summary": summary, "across": int(statistics.median(across[args.warmup :])), "equal": bool(equal and changed)}  # fmt: skip

                    baseline = per_rate(hosts, rates, "baseline", baseline_at)
            finally:
                leftover = on_b.call(engine_stop)[0]
                if leftover:
                    _log(f"killed engine processes that outlived shutdown: {leftover}")
    traffic = Traffic(recv_inter={int(k): int(v) for k, v in into.items()})
    topology = Topology(TRAINERS, TP, TRAINERS, TP)
    rows = []
    for rate in rates:
        o, b, p = ours[rate], baseline.get(rate), pulls.get(rate)
        link_bps = rate or o["measured"]
        modeled, _ = node_link_seconds(traffic, topology, link_bps / 8)
        ours_s = float(o["summary"]["seconds"])
        row: dict[str, Any] = {
            "rate_bps": rate or None,
            "link_measured_bps": round(o["measured"]),
            "ours_s": round(ours_s, 4),
            "ours_all_s": list(o["summary"]["all_seconds"]),
            "baseline_s": round(float(b["summary"]["seconds"]), 4) if b else None,
            "baseline_all_s": list(b["summary"]["all_seconds"]) if b else [],
            "bytes_across": o["across"],
            "baseline_bytes_across": b["across"] if b else None,
            "link_bound_s": round(o["across"] * 8 / link_bps, 4),
            "delta_rows": deltas.get(rate, {}).get("delta_rows", []),
            "modeled_s": round(modeled, 4),
            "bitwise_equal": o["equal"],
            "ours_rollout_phase_s": o["summary"]["rollout_phase_s"],
            "baseline_bitwise_equal": b["equal"] if b else None,
        }
        if p:
            row["ours_pull_s"] = round(float(p["summary"]["seconds"]), 4)
            row["ours_pull_all_s"] = list(p["summary"]["all_seconds"])
            row["pull_bytes_across"] = p["across"]
            row["ours_pull_over_link_bound"] = round(row["ours_pull_s"] / row["link_bound_s"], 3)
            row["pull_bitwise_equal"] = p["equal"]
            row["ours_pull_rollout_phase_s"] = p["summary"]["rollout_phase_s"]
            row["ours_pull_delta_rows"] = pull_deltas.get(rate, {}).get("delta_rows", [])
        row["speedup"] = round(row["baseline_s"] / ours_s, 3) if b else None
        row["ours_over_link_bound"] = round(ours_s / row["link_bound_s"], 3)
        row["modeled_over_ours"] = round(modeled / ours_s, 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks hosts", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "rollout-sync")
    parser.add_argument(
        "--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES), help="bits/s; 0: unshaped"
    )
    parser.add_argument("--syncs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--cap-mib", type=int, default=64, help="staging cap of ours, MiB")
    parser.add_argument("--methods", default="ours,pull,delta,baseline", help="which to run besides ours")
    args = parser.parse_args(argv)
    if args.syncs < 1 or args.warmup < 0:
        parser.error("--syncs must be >= 1 and --warmup >= 0")
    args.methods = {m for m in args.methods.split(",") if m}
    if args.methods - {"ours", "pull", "delta", "baseline"}:
        parser.error(f"--methods takes ours, pull, delta, baseline, found {sorted(args.methods)}")
    os.environ["DS_ACCELERATOR"] = "cpu"
    from testbed.hosts import available
    from testbed.shaped_models import make_shaped_model

    why = available()
    if why is not None:
        parser.error(why)
    model = make_shaped_model(MODEL_KIND, args.workdir / MODEL_KIND)
    rows = run(args, model)
    for r in rows:
        rate = (
            f"{r['rate_bps'] / 1e9:g} Gbit/s"
            if r["rate_bps"]
            else f"unshaped ({r['link_measured_bps'] / 1e9:.1f} Gbit/s)"
        )
        deltas = ", ".join(f"{d['changed_fraction']:.0%} {d['ours_delta_s']:.2f} s" for d in r["delta_rows"])
        _log(
            f"{rate}: ours {r['ours_s']:.2f} s vs baseline {r['baseline_s']} s ({r['speedup']}x); "
            f"{r['bytes_across'] / 1e9:.3f} GB across, link bound {r['link_bound_s']:.2f} s "
            f"({r['ours_over_link_bound']:.2f}x), modeled {r['modeled_s']:.2f} s; delta {deltas}; "
            f"bitwise {r['bitwise_equal']}"
            + (
                f"; pull (NIXL, no group) {r['ours_pull_s']:.2f} s ({r['ours_pull_over_link_bound']:.2f}x the "
                f"link bound), bitwise {r['pull_bitwise_equal']}"
                if "ours_pull_s" in r
                else ""
            )
        )
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0 if all(r["bitwise_equal"] for r in rows) else 1
