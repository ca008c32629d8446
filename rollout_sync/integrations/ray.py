"""Ray: DeepSpeed trainer ranks and vLLM engines placed as Ray actors meet through Ray, not through an
address anybody types.

    # in every trainer actor (DeepSpeed rank r of W), after deepspeed.initialize:
    sync = attach_in_ray(engine, job="grpo", engines=1)
    # in every engine actor (it owns an LLM started with RolloutSyncExtension), at the same time:
    setup_engines([llm], first_rank=W)                 # once per engine: its target maps
    connect_in_ray(llm, job="grpo", engine=0)

The rendezvous is a named Ray actor (``RolloutSyncRendezvous``, named ``rollout-sync:<job>`` in the job's
namespace; on the head node). Trainer rank 0 serves the coordinator on its node's address (``ray.util.get_node_ip_address``,
the address Ray itself reaches the node by) at a free port, draws a token, and publishes both; the other
trainer ranks and every engine read them from the rendezvous (each wait bounded by ``timeout``, through
``ray.get(..., timeout=...)``). Every later handshake of the job (after a failed sync, with a replacement
engine) publishes a new round, which the ranks read by its number.

Where actors land is Ray's business (placement groups, node resources): ranks that share a node share a
machine key (``sync.machine``) and use the same-host transports; ranks on other nodes use the sync group.
"""

from __future__ import annotations

import secrets
import socket
import time
from typing import Any

import ray

from ..errors import SyncTimeoutError
from ..sync.options import SyncOptions

HEAD_NODE_RESOURCE_NAME = "node:__internal_head__"  # the resource Ray gives its head node alone

__all__ = [
    "RolloutSyncRendezvous",
    "attach_in_ray",
    "connect_in_ray",
    "meeting",
    "release_in_ray",
    "rendezvous",
]


@ray.remote(num_cpus=0)
class RolloutSyncRendezvous:
    """The rounds of one job's handshakes: round -> (coordinator address, token)."""

    def __init__(self) -> None:
        self.rounds: dict[int, tuple[str, str]] = {}

    def publish(self, round_: int, address: str, token: str) -> int:
        self.rounds[round_] = (address, token)
        return round_

    def lookup(self, round_: int) -> tuple[str, str] | None:
        return self.rounds.get(round_)

    def latest(self) -> int:
        return max(self.rounds, default=0)


def rendezvous(job: str) -> Any:
    """The job's rendezvous actor, made by whoever asks first; detached, so that it outlives that actor
    (``release_in_ray`` ends it), and on the head node (as Ray Train places its state actor), so that a lost worker
    node does not take the job's later handshakes with it."""
    return RolloutSyncRendezvous.options(  # type: ignore[attr-defined]
        name=f"rollout-sync:{job}",
        get_if_exists=True,
        lifetime="detached",
        resources={HEAD_NODE_RESOURCE_NAME: 0.001},
        scheduling_strategy="DEFAULT",  # not in the caller's placement group
    ).remote()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def meeting(job: str, round_: int, *, publish: bool, timeout: float) -> tuple[str, str]:
    """Round ``round_``'s coordinator address and token: published here (``publish``: on trainer rank 0, its
    node's address, a free port, a fresh token), else read, waiting up to ``timeout``."""
    actor = rendezvous(job)
    if publish:
        host = ray.util.get_node_ip_address()
        address, token = f"tcp://{host}:{_free_port(host)}", secrets.token_hex(16)
        ray.get(actor.publish.remote(round_, address, token), timeout=timeout)
        return address, token
    deadline = time.monotonic() + timeout
    while True:
        got = ray.get(actor.lookup.remote(round_), timeout=timeout)
        if got is not None:
            return str(got[0]), str(got[1])
        if time.monotonic() > deadline:
            raise SyncTimeoutError(
                f"no handshake round {round_} of job {job!r} was published within {timeout:g} s "
                "(trainer rank 0 publishes it when it attaches)"
            )
        time.sleep(0.05)


def attach_in_ray(
    engine: Any,
    *,
    job: str,
    engines: int,
    round_: int = 1,
    options: SyncOptions | None = None,
    **overrides: Any,
) -> Any:
    """``TrainerSync.attach`` on this DeepSpeed rank, meeting through the job's rendezvous (every trainer rank
    calls it; rank 0 publishes round ``round_``). ``options`` (``SyncOptions``, or its fields as keywords, and
    ``TrainerSync.attach``'s ``every``, ``state``, ``lora``); the rendezvous waits at most the timeout."""
    import torch.distributed as dist

    from ..trainer.hook import TrainerSync

    attach_keys = {"every", "state", "lora"}
    attach_args = {k: v for k, v in overrides.items() if k in attach_keys}
    opts = SyncOptions.of(options, **{k: v for k, v in overrides.items() if k not in attach_keys})
    address, token = meeting(job, round_, publish=dist.get_rank() == 0, timeout=opts.timeout)
    return TrainerSync.attach(
        engine, address=address, engines=engines, token=token, options=opts, **attach_args
    )


def connect_in_ray(
    llm: Any, *, job: str, engine: int, round_: int = 1, timeout: float = SyncOptions.timeout, **options: Any
) -> Any:
    """Join ``llm``'s workers (set up before: ``setup_engines``) as engine ``engine`` of the job's handshake
    round ``round_``. ``options``: ``connect_engine``'s others (``atomic``, ``staging_cap_bytes``)."""
    from vllm_plugin.driver import connect_engine

    address, token = meeting(job, round_, publish=False, timeout=timeout)
    return connect_engine(llm, address, engine, token=token, timeout=timeout, **options)


def release_in_ray(job: str) -> None:
    """End the job's rendezvous (it is detached: it outlives the actor that made it)."""
    try:
        actor = ray.get_actor(f"rollout-sync:{job}")
    except ValueError:
        return
    ray.kill(actor)
