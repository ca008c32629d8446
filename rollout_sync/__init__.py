"""rollout-sync: move freshly trained DeepSpeed weights into running vLLM engines, directly from where the
trainer stores each element to where vLLM stores it, with a plan computed once and reused at every step."""

__version__ = "0.1.0"
