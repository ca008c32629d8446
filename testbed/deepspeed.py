"""Real DeepSpeed training engines on CPU ranks (gloo), built from a (tiny) checkpoint: for tests, the
example and the benchmarks.

Facts this module encodes (``shared/notes/deepspeed-on-cpu.md``):
- ``DS_ACCELERATOR=cpu``; ``deepspeed.init_distributed(dist_backend="gloo")``.
- The optimizer is always a config optimizer with ``"torch_adam": true`` (or torch's SGD): a config AdamW
  without it JIT-compiles FusedAdam (~160 s), and AutoEP needs a config optimizer (MoE param groups).
- Every rank loads the full checkpoint with ``from_pretrained`` (the models are tiny). ZeRO-3 then either
  partitions the loaded module inside ``deepspeed.initialize`` (default), or, with ``zero_init=True``,
  builds the model inside ``zero.Init`` and copies the checkpoint in through ``GatheredParameters`` (the way
  large models are built). Model classes are imported before ``zero.Init`` patches tensor construction.
- DeepSpeed's ``TorchBackend`` JIT-compiles a shared-memory comm op (~60 s on the first run on a machine).
  That op serves only ``inference_all_reduce``; training collectives go through gloo either way. DeepSpeed
  has no switch to skip the build, so ``init_distributed_from_env`` skips it by making
  ``deepspeed.comm.torch.build_shm_op`` return ``None`` (what DeepSpeed does where the op is not
  compatible). ``ROLLOUT_SYNC_TEST_DS_SHM=1`` keeps the real build.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_sync.tiny import TinyKind

__all__ = [
    "DeepSpeedSpec",
    "build_engine",
    "checkpoint_mismatches",
    "full_parameters",
    "init_distributed_from_env",
    "skip_shm_build_unless_asked",
    "train_step",
]

_SHM_ENV = "ROLLOUT_SYNC_TEST_DS_SHM"

Dtype = Literal["bf16", "fp32"]
Optimizer = Literal["adamw", "sgd"]


@dataclass(frozen=True)
class DeepSpeedSpec:
    """One DeepSpeed training configuration on a tiny model (``kind``, see ``tiny_models``).

    ``zero_init`` (ZeRO-3 only) builds the model inside ``zero.Init`` instead of partitioning a loaded
    module at ``deepspeed.initialize``; both start from the checkpoint bit for bit (smoke-tested).
    ``extra_config`` is deep-merged into the generated DeepSpeed config (for knobs such as
    ``zero_optimization.round_robin_gradients`` or bucket sizes).
    """

    kind: TinyKind = "dense"
    zero_stage: int = 0
    autotp_size: int = 1
    autoep_size: int = 1
    dtype: Dtype = "bf16"
    optimizer: Optimizer = "adamw"
    lr: float = 1e-3
    zero_init: bool = False
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    #: ``peft.LoraConfig`` arguments: the model is wrapped with ``peft.get_peft_model`` (A drawn from seed
    #: 0 on every rank; B, zero at PEFT's init, drawn too, so a first sync already moves non-zero values).
    lora: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, found {self.zero_stage}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype must be 'bf16' or 'fp32' (fp16 is refused on CPU), found {self.dtype!r}")
        if self.autotp_size < 1 or self.autoep_size < 1:
            raise ValueError(
                f"autotp_size and autoep_size must be >= 1, found {self.autotp_size} and {self.autoep_size}"
            )
        if self.autoep_size > 1 and self.kind != "moe":
            raise ValueError(f"AutoEP needs the 'moe' tiny model, found kind {self.kind!r}")

    def ds_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
            "zero_optimization": {"stage": self.zero_stage},
            "bf16": {"enabled": self.dtype == "bf16"},
        }
        if self.optimizer == "adamw":
            config["optimizer"] = {"type": "AdamW", "params": {"lr": self.lr, "torch_adam": True}}
        else:
            config["optimizer"] = {"type": "SGD", "params": {"lr": self.lr}}
        if self.autotp_size > 1:
            config["tensor_parallel"] = {"autotp_size": self.autotp_size}
        if self.autoep_size > 1:
            config["expert_parallel"] = {
                "enabled": True,
                "autoep_size": self.autoep_size,
                "preset_model": "qwen3_moe",
            }
        return _deep_merge(config, self.extra_config)

    @property
    def torch_dtype_name(self) -> str:
        return "bfloat16" if self.dtype == "bf16" else "float32"


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def skip_shm_build_unless_asked() -> None:
    if os.environ.get(_SHM_ENV, "0") == "1":
        return
    import importlib

    # ``import deepspeed.comm.torch as m`` binds the attribute ``torch`` of ``deepspeed.comm``: the torch
    # library itself, not DeepSpeed's module (so the patch used to miss and the op was built anyway)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    setattr(ds_torch_comm, "build_shm_op", lambda: None)  # noqa: B010 (a module attribute)


def init_distributed_from_env() -> None:
    """Initialise DeepSpeed's default (gloo) process group from ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE`` (as ``testbed.rank_pool`` and launchers set them)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    skip_shm_build_unless_asked()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def build_engine(spec: DeepSpeedSpec, model_path: str | os.PathLike[str]) -> Any:
    """Load the checkpoint and build the DeepSpeed engine for ``spec`` (inside an initialised rank)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch

    # Import the model classes before zero.Init patches tensor construction (see module doc).
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401

    config = spec.ds_config()
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    if spec.zero_stage == 3 and spec.zero_init:
        model = _rebuild_under_zero_init(loaded, AutoConfig.from_pretrained(str(model_path)), config, dtype)
    else:
        model = loaded
    if spec.lora is not None:
        model = _with_lora(model, spec.lora)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def _with_lora(model: Any, lora: Mapping[str, Any]) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    wrapped = get_peft_model(model, LoraConfig(**dict(lora)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.2).to(p.dtype))
    return wrapped


def _rebuild_under_zero_init(loaded: Any, hf_config: Any, ds_config: dict[str, Any], dtype: Any) -> Any:
    """Build the model inside ``zero.Init`` (parameters partitioned at construction, as large models are
    built) and copy the loaded checkpoint into it, one gathered parameter at a time.

    transformers' initialisers index into parameters (``weight[padding_idx].zero_()``), which fails on an
    empty ZeRO-3 partition, so they are switched off with ``no_init_weights`` (transformers' own switch for
    this case); that also skips weight tying, which is redone here."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.tie_weights()
    source = dict(loaded.named_parameters())
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(source[name])
    # zero.Init casts buffers to ``dtype``; the loaded model keeps e.g. rotary ``inv_freq`` in fp32. Take
    # the loaded buffers as they are (dtype included), so both build paths compute the same forward.
    loaded_modules = dict(loaded.named_modules())
    for module_name, module in model.named_modules():
        for buffer_name in list(module._buffers):
            module._buffers[buffer_name] = loaded_modules[module_name]._buffers[buffer_name]
    return model


def train_step(engine: Any, seed: int = 0, batch: int = 1, seq_len: int = 16, vocab: int = 1000) -> float:
    """One forward, backward and optimizer step on random tokens drawn from ``seed`` (the same on every
    rank, so that tensor- and expert-parallel ranks see the same batch); returns the loss."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (batch, seq_len), generator=gen).to(engine.device)
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach().float().item())


def full_parameters(engine: Any) -> dict[str, Any]:
    """Every parameter of the engine's module as a full tensor (a gathered copy under ZeRO-3), by the
    module's own parameter names. Collective under ZeRO-3: call it on every rank. Not for AutoTP or AutoEP
    engines, whose modules hold shards under other names."""
    import deepspeed

    out: dict[str, Any] = {}
    for name, param in engine.module.named_parameters():
        if hasattr(param, "ds_id"):
            with deepspeed.zero.GatheredParameters([param]):
                out[name] = param.detach().clone()
        else:
            out[name] = param.detach().clone()
    return out


def checkpoint_mismatches(engine: Any, model_path: str | os.PathLike[str]) -> list[str]:
    """Names of parameters and buffers of the engine's module that differ (bits or dtype) from the same
    checkpoint loaded by plain ``from_pretrained`` at the engine's dtype; empty when the engine starts from
    exactly the checkpoint. Collective under ZeRO-3 (see ``full_parameters``)."""
    import torch
    from transformers import AutoModelForCausalLM

    params = full_parameters(engine)
    dtype = next(iter(params.values())).dtype
    reference = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    expected = dict(reference.named_parameters())
    mismatches = sorted(set(expected) ^ set(params))
    for name, tensor in params.items():
        if name in expected and not (
            tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name].detach())
        ):
            mismatches.append(name)
    expected_buffers = dict(reference.named_buffers())
    for name, buffer in engine.module.named_buffers():
        ref = expected_buffers.get(name)
        if ref is None or ref.dtype != buffer.dtype or not torch.equal(ref, buffer):
            mismatches.append(f"buffer {name}")
    return mismatches
