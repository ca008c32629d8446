"""rollout-sync: move freshly trained DeepSpeed weights into running vLLM engines, directly from where the
trainer stores each element to where vLLM stores it, with a plan computed once and reused at every step.

Where a thing lives (one rule per folder):

- ``layout/``: pure geometry of boxes, pieces, maps and runs; knows no framework.
- ``shapes/``: shape tables of real models, composed with each side's geometry into whole-model maps.
- ``planning/``: pure; maps to a plan of segments, its digest and its wire form.
- ``transport/``: executing a rank's half of a plan over a process group, with bounded staging.
- ``handshake/``: the ZeroMQ messages that exchange maps and hand out plan halves.
- ``sync/``: what both sides run at each sync: the endpoint, the coordinator's work, the commit, the roster.
- ``trainer/``: the DeepSpeed side: DeepSpeed's storage geometry, reading a live engine, the trainer hook.
- ``rollout/``: the vLLM side that needs no vLLM: vLLM's storage geometry, target maps, the link to the
  sync group, writes into storage views. What runs inside vLLM's processes and touches vLLM's objects is
  the separate ``vllm_plugin`` package (the only code that imports vLLM).
- ``integrations/``: TRL and transformers' ``Trainer``.
- ``scale/``: the shape-only dry run behind ``rollout-sync plan``.
- ``interop/``: conversion to DeepSpeed's affine IR.
- ``bench/``: the benchmarks (``python -m rollout_sync.bench``), run from a checkout; not installed, and
  nothing else imports them. What tests, examples and benchmarks share is ``testbed/`` beside the package.

DeepSpeed is imported only on the trainer side, and only when an engine is read: a vLLM host installs the
package without it (extra ``[rollout]``; the trainer installs ``[trainer]``).
"""

__version__ = "0.1.0"
