"""GRPO with the trainer ranks and the vLLM engine as Ray actors, as OpenRLHF and verl place them.

    python examples/ray_grpo.py --steps 3 --verify                     # a local Ray instance on this machine
    python examples/ray_grpo.py --address HEAD:6379 --trainer-resource host_a --engine-resource host_b --verify

Two DeepSpeed ZeRO-3 trainer actors (a tiny Qwen3 made locally, no download) and one vLLM engine actor (TP 2,
its workers spawned by the actor). They meet through ``rollout_sync.integrations.ray``: trainer rank 0
publishes the coordinator's address (its node's IP) and a token in a named Ray actor, the others read them;
nobody types an address. Each step the engine samples groups of completions, the driver scores them, both
trainer actors take a policy-gradient step (``examples/grpo.py``'s) and their hook syncs the new weights
into the engine actor, which receives at the same time. With ``--verify`` the trainer's weights, gathered by
DeepSpeed itself, are written into the engine through vLLM's own loader maps after each sync and no bit may
change. On a cluster, ``--trainer-resource`` / ``--engine-resource`` name custom node resources that put the
trainer actors and the engine on the nodes that have them.

When a sync fails because the engine actor is lost (its node died), the driver starts a replacement engine
(``--replace-lost-engine``), the trainer actors and it meet in the next handshake round, and training goes
on. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

JOB = "ray-grpo"
TIMEOUT = float(os.environ.get("RAY_GRPO_TIMEOUT", "120"))  # every wait of a handshake and a sync


@ray.remote(num_cpus=0)
class TrainerRank:
    """One DeepSpeed rank (ZeRO-3) of the trainer."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.state: dict[str, Any] = {}

    def node(self) -> str:
        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind((self.node(), 0))
            return int(s.getsockname()[1])

    def setup(self, master: str, port: int, model: str, lr: float) -> str:
        os.environ.update(
            {"RANK": str(self.rank), "LOCAL_RANK": str(self.rank), "WORLD_SIZE": str(self.world)}
        )
        os.environ.update({"MASTER_ADDR": master, "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
        from grpo import setup  # examples/grpo.py's trainer rank commands (this folder is on Ray's path)

        setup(self.state, self.rank, self.world, model, {"zero": 3, "lr": lr})
        return self.node()

    def attach(self, engines: int, round_: int) -> int:
        from rollout_sync import attach_in_ray

        old = self.state.pop("sync", None)
        if old is not None:
            old.detach()
        sync = attach_in_ray(self.state["engine"], job=JOB, engines=engines, round_=round_, timeout=TIMEOUT)
        self.state["sync"] = sync
        return int(sync.endpoint.rank)

    def step(self, batch: list[tuple[list[int], list[int], float]]) -> dict[str, Any]:
        from grpo import grpo_step

        try:
            return grpo_step(self.state, self.rank, self.world, batch)
        except Exception as exc:  # the optimizer step applied; its sync failed (on every rank)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def save(self, out: str, model: str) -> None:
        self.state["sync"].save_reference(model, out)


@ray.remote(num_cpus=0)
class Engine:
    """A vLLM engine (TP 2, its workers spawned here) with rollout-sync's worker extension."""

    def __init__(self, model: str, first_rank: int) -> None:
        from grpo import engine_env

        engine_env(2)  # its workers' CPU threads
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM's import reads it
        from vllm import LLM

        from rollout_sync import setup_engines

        self.llm = LLM(
            model=model,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=16,
            kv_cache_memory_bytes=64 * 2**20,
            seed=0,
            worker_extension_cls="vllm_plugin.extension.RolloutSyncExtension",
        )
        setup_engines([self.llm], first_rank=first_rank)

    def node(self) -> str:
        return str(ray.util.get_node_ip_address())

    def connect(self, round_: int) -> list[dict[str, Any]]:
        from rollout_sync import connect_in_ray

        return connect_in_ray(self.llm, job=JOB, engine=0, round_=round_, timeout=TIMEOUT)

    def generate(
        self, prompts: list[list[int]], group: int, max_tokens: int, seed: int
    ) -> list[list[list[int]]]:
        from vllm import SamplingParams

        params = SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[list(c.token_ids) for c in out.outputs] for out in outputs]

    def receive(self) -> list[dict[str, Any]]:
        from rollout_sync import receive_sync

        return receive_sync([self.llm])[0]

    def changed_by(self, checkpoint: str) -> int:
        from rollout_sync import verify_engine

        return len(verify_engine(self.llm, checkpoint))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument(
        "--verify", action="store_true", help="check after each sync that the engine holds the weights"
    )
    ap.add_argument("--address", default=None, help="a Ray cluster to join (default: a local instance)")
    ap.add_argument("--trainer-resource", default=None, help="a custom node resource the trainer actors need")
    ap.add_argument("--engine-resource", default=None, help="a custom node resource the engine actor needs")
    ap.add_argument("--replace-lost-engine", action="store_true", help="start a new engine when one is lost")
    ap.add_argument(
        "--replacement-resource", default=None, help="a custom node resource the replacement engine needs"
    )
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rollout-sync-ray-grpo"))
    return ap.parse_args(argv)


def placed(
    actor: Any, bundles: int, cpus: float, resource: str | None, strategy: str = "STRICT_PACK"
) -> tuple[Any, list[Any]]:
    """``bundles`` actors of class ``actor`` in a placement group of their own (``strategy``: STRICT_PACK puts
    them on one node, so that they share same-host transports), each bundle on a node with ``resource``."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle: dict[str, float] = {"CPU": cpus, **({resource: 0.01} if resource else {})}
    group = placement_group([dict(bundle) for _ in range(bundles)], strategy=strategy)
    ray.get(group.ready(), timeout=TIMEOUT)
    return group, [
        actor.options(
            num_cpus=cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        )
        for i in range(bundles)
    ]


def start_engine(model: str, world: int, resource: str | None) -> tuple[Any, Any, str]:
    """An engine actor in a placement group of its own, started (vLLM up, its target maps set) before any
    handshake waits for it: its placement group, the actor and its node's address."""
    group, (actor,) = placed(Engine, 1, 2, resource)
    engine = actor.remote(model, world)
    return group, engine, str(ray.get(engine.node.remote(), timeout=600))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from cpu import tiny_checkpoint

    model = str(tiny_checkpoint("dense", Path(args.workdir) / "tiny-dense"))
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["RAY_GRPO_TIMEOUT"] = str(TIMEOUT)
    if args.address:
        ray.init(address=args.address, namespace=JOB, runtime_env={"env_vars": env}, log_to_driver=False)
    else:
        ray.init(
            address="local",  # a new instance, even where a cluster runs on this machine
            num_cpus=4,
            namespace=JOB,
            include_dashboard=False,
            runtime_env={"env_vars": env},
            log_to_driver=False,
        )
    from rollout_sync import release_in_ray

    world = 2
    _, ranks = placed(TrainerRank, world, 1, args.trainer_resource)
    trainers = [a.remote(r, world) for r, a in enumerate(ranks)]
    master, port = ray.get([trainers[0].node.remote(), trainers[0].free_port.remote()], timeout=TIMEOUT)
    nodes = ray.get([t.setup.remote(master, port, model, args.lr) for t in trainers], timeout=600)
    engine_group, engine, engine_node = start_engine(model, world, args.engine_resource)
    round_ = 1
    ray.get([*(t.attach.remote(1, round_) for t in trainers), engine.connect.remote(round_)], timeout=600)
    summary: dict[str, Any] = {
        "trainer_nodes": nodes,
        "engine_node": engine_node,
        "steps": [],
    }
    print(
        f"[ray-grpo] trainer on {nodes}, engine on {summary['engine_node']}: joined through Ray", flush=True
    )
    gen = random.Random(0)
    step = 0
    while step < args.steps:
        step += 1
        prompts = [[gen.randrange(4, 1000) for _ in range(6)] for _ in range(args.prompts)]
        groups = ray.get(engine.generate.remote(prompts, args.group, args.max_tokens, step), timeout=TIMEOUT)
        batch = []
        rewards = []
        for prompt, group in zip(prompts, groups, strict=True):
            scores = [sum(4 <= t < 500 for t in c) / max(len(c), 1) for c in group]
            mean = sum(scores) / len(scores)
            std = (sum((s - mean) ** 2 for s in scores) / len(scores)) ** 0.5
            batch += [(prompt, c, (s - mean) / (std + 1e-4)) for c, s in zip(group, scores, strict=True)]
            rewards += scores
        print(f"step {step}: training and syncing", flush=True)
        stepping = [t.step.remote(batch) for t in trainers]
        receiving = engine.receive.remote()
        results = ray.get(stepping, timeout=600)
        try:
            workers = ray.get(receiving, timeout=TIMEOUT)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            workers = None
            lost = f"{type(exc).__name__}: {str(exc)[:300]}"
        if workers is None or any("error" in r for r in results):
            error = next((r["error"] for r in results if "error" in r), lost if workers is None else "")
            row = {"step": step, "error": error}
            summary["steps"].append(row)
            print(f"step {step}: the sync failed: {error[:200]}", flush=True)
            if not args.replace_lost_engine:
                break
            started = time.monotonic()
            ray.kill(engine)
            ray.util.remove_placement_group(engine_group)  # else Ray re-places a lost node's bundle
            engine_group, engine, row["engine_node"] = start_engine(model, world, args.replacement_resource)
            round_ += 1
            ray.get(
                [*(t.attach.remote(1, round_) for t in trainers), engine.connect.remote(round_)], timeout=600
            )
            row["replaced_in_s"] = round(time.monotonic() - started, 2)
            continue
        version = results[0]["sync"]["version"]
        row = {
            "step": step,
            "reward": round(sum(rewards) / len(rewards), 4),
            "version": version,
            "sync_s": round(max(r["sync"]["seconds"] for r in results), 4),
            "engine_versions": sorted({w["version"] for w in workers}),
            # Trainer -> engine bytes by path: over the sync group (another node), or straight from memory
            # the engine's workers mapped (the same node: shared memory).
            "group_bytes": sum(
                n
                for r in results
                for peer, n in r["sync"]["stats"]["bytes_sent"].items()
                if int(peer) >= world
            ),
            "same_host_bytes": sum(
                n
                for r in results
                for peer, n in r["sync"]["stats"]["bytes_mapped"].items()
                if int(peer) >= world
            ),
        }
        if args.verify:
            checkpoint = str(Path(args.workdir) / f"verify-{step}")
            ray.get([t.save.remote(checkpoint, model) for t in trainers], timeout=TIMEOUT)
            row["params_differing"] = ray.get(engine.changed_by.remote(checkpoint), timeout=TIMEOUT)
            row["verified"] = row["params_differing"] == 0
        summary["steps"].append(row)
        print(
            f"step {step}: reward {row['reward']:.3f}, synced v{version} in {row['sync_s'] * 1000:.0f} ms"
            + (
                f", engine == trainer bit for bit: {'yes' if row['verified'] else 'NO'}"
                if args.verify
                else ""
            ),
            flush=True,
        )
    done = [r for r in summary["steps"] if "error" not in r]
    summary["ok"] = bool(done) and all(
        r.get("verified", True) and r["engine_versions"] == [r["version"]] for r in done
    )
    release_in_ray(JOB)  # the job's rendezvous actor (detached; attach_in_ray made it)
    ray.shutdown()
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
