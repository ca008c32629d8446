"""Benchmarks: commands that run a baseline side by side with ours in the same run and print figures.

``python -m rollout_sync.bench NAME [args]`` runs ``rollout_sync.bench.NAME.main(args)``.
"""
