"""The old name of the benchmarks: ``python -m rollout_sync.bench ...`` forwards to ``python -m benchmarks ...``
(the checkout's top-level ``benchmarks/``, not installed)."""
