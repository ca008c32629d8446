"""Benchmarks: commands that run a baseline side by side with ours in the same run and print figures.

``python -m benchmarks NAME [args]`` runs ``benchmarks.NAME.main(args)``.
"""
