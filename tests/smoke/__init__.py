"""Smoke tests: the harness brings up real ranks, DeepSpeed engines and vLLM engines on this machine."""
