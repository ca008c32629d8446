"""Test harness: tiny models, rank runner, real DeepSpeed and vLLM engines on CPU."""
