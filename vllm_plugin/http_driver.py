"""Drive a ``vllm serve`` server that runs ``RolloutSyncExtension`` over its own HTTP routes.

The server must run with ``VLLM_SERVER_DEV_MODE=1`` (vLLM 0.32 exposes ``/collective_rpc``, ``/pause``,
``/resume`` and ``/update_weight_version`` only then). Every rollout-sync call goes through
``/collective_rpc`` as ``rollout_sync_call`` with a fresh nonce, and every worker's answer must carry that
nonce (``vllm_plugin.calls``, shared with the offline driver): a stale answer raises ``StaleAnswerError``
instead of being trusted.

``ServerEngine`` has ``collective_rpc(method, args, kwargs)``, so ``vllm_plugin.driver.setup_engines``
accepts it like an offline ``vllm.LLM``. A sync is ``pause`` (clears the prefix cache), ``receive`` on
every worker, ``resume``; only a sync every worker completed moves the server's weight version. A failed
sync resumes the server (it keeps serving, its workers report ``incomplete``) and raises naming the engine.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_sync.errors import PeerFailedError, SyncTimeoutError
from rollout_sync.sync.options import SyncOptions

from .calls import PREFIX, call_request, check_answers

__all__ = ["ServerEngine", "check_answers", "rpc_timeout"]


def rpc_timeout(limit: float) -> float:
    """vLLM's RPC timeout for a call whose HTTP wait is ``limit`` seconds (see ``ServerEngine.call``)."""
    return 3 * limit + 60.0


class ServerEngine:
    """One ``vllm serve`` server at ``url`` (``http://127.0.0.1:8000``), named ``name`` in errors."""

    def __init__(self, url: str, name: str | None = None, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.timeout = timeout

    # -- HTTP ---------------------------------------------------------------------------------------
    def request(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="GET" if data is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        limit = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=limit) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise PeerFailedError(f"engine {self.name}: {path} returned {exc.code}: {detail}") from exc
        except TimeoutError as exc:
            raise SyncTimeoutError(f"engine {self.name}: {path} gave no answer within {limit} s") from exc
        except (urllib.error.URLError, ConnectionError) as exc:
            raise PeerFailedError(f"engine {self.name}: {path} unreachable: {exc}") from exc
        return json.loads(raw) if raw else None

    def wait_ready(self, timeout: float) -> float:
        """Poll ``/health`` until it answers; returns the seconds waited."""
        start = time.monotonic()
        while True:
            try:
                self.request("/health", timeout=5.0)
                return time.monotonic() - start
            except (PeerFailedError, SyncTimeoutError) as exc:
                if time.monotonic() - start > timeout:
                    raise SyncTimeoutError(f"engine {self.name} not ready after {timeout} s: {exc}") from exc
                time.sleep(1.0)

    # -- rollout-sync calls ---------------------------------------------------------------------------
    def call(
        self,
        method: str,
        kwargs: Mapping[str, Any] | None = None,
        args: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> list[Any]:
        """``rollout_sync_<method>`` on every worker, with a fresh nonce checked on every answer.

        The HTTP wait is bounded by ``timeout`` (plus 10 s); vLLM's own RPC timeout is set well past it
        (``rpc_timeout``). When vLLM times an RPC out at TP > 1 the workers' late answers stay queued and
        every later call receives its predecessor's answer (which the nonces then refuse, but the server's
        RPCs stay shifted for good); a call that outlives the HTTP wait instead only delays the next call,
        which still gets its own answer."""
        nonce = uuid.uuid4().hex
        limit = self.timeout if timeout is None else timeout
        body = {
            "method": "rollout_sync_call",
            "kwargs": call_request(method, nonce, kwargs, args),
            "timeout": rpc_timeout(limit),
        }
        got = self.request("/collective_rpc", body, timeout=limit + 10.0)
        answers = got.get("results") if isinstance(got, dict) else got
        return check_answers(self.name, method, nonce, answers)

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """``vllm.LLM.collective_rpc``'s shape for ``rollout_sync_*`` methods (``driver.setup_engines``)."""
        if not method.startswith(PREFIX):
            raise ValueError(f"engine {self.name}: only rollout_sync_* methods go over HTTP, not {method!r}")
        return self.call(method[len(PREFIX) :], kwargs, args)

    def connect(
        self,
        address: str,
        engine: int,
        token: str | None,
        timeout: float = SyncOptions.timeout,
        atomic: bool = False,
    ) -> list[Any]:
        """Join the sync group (blocks until the trainer has joined: run it in a thread). ``atomic``: a
        failed sync leaves the old weights (``driver.connect_engine``)."""
        kwargs: dict[str, Any] = {"address": address, "engine": engine, "token": token, "timeout": timeout}
        if atomic:
            kwargs["atomic"] = True
        return self.call("connect", kwargs, timeout=timeout + 10.0)

    def receive(
        self, timeout: float | None = None, *, mode: str = "abort", kv: str = "keep"
    ) -> list[dict[str, Any]]:
        """One sync into a paused server, resumed afterwards whether it succeeded or not. ``mode``: vLLM's
        ``/pause`` mode for requests in flight (``abort``, vLLM's default, which also clears the caches;
        ``wait``; ``keep``: frozen, they go on with the new weights from their next token). ``kv``, in keep
        mode: ``keep`` their KV cache or ``recompute`` it with the new weights (``async_driver``). On
        success the server's weight version becomes the received version (which also makes it forget its
        prefix cache: ``prefix_cache``); on failure it keeps its old version, its workers report
        ``incomplete``, ``PeerFailedError`` names it, and in keep mode its frozen requests resume on the old
        weights where the workers are ``atomic`` and are aborted where they are not."""
        query = f"?mode={mode}" + ("&clear_cache=false" if mode != "abort" else "")
        self.request("/pause" + query, {})
        try:
            reports = self.call("receive", timeout=timeout)
        except BaseException:
            if mode == "keep" and not all(s.get("atomic") for s in self.status()):
                self.request("/pause?mode=abort&clear_cache=false", {})  # no version names these weights
            self.request("/resume", {})
            raise
        try:
            versions = {r["version"] for r in reports}
            if len(versions) != 1 or any(r["incomplete"] for r in reports):
                raise PeerFailedError(f"engine {self.name}: workers disagree after a sync: {reports}")
            if mode == "keep" and kv == "recompute":
                self.request("/reset_prefix_cache?reset_running_requests=true", {})
            self.request("/update_weight_version", {"new_version": str(versions.pop())})
        finally:
            self.request("/resume", {})
        return list(reports)

    def status(self) -> list[dict[str, Any]]:
        return self.call("status")

    def weight_version(self) -> str:
        return str(self.request("/weight_info")["weight_version"])

    def complete_greedy(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids for token-id prompts through ``/v1/completions``."""
        out = []
        for prompt in prompts:
            got = self.request(
                "/v1/completions",
                {
                    "prompt": list(prompt),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            out.append([int(t) for t in got["choices"][0]["token_ids"]])
        return out
