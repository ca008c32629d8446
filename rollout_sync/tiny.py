"""Tiny Qwen3 checkpoints built locally, with no download: for trying rollout-sync (the examples, the README
demo) and for its tests. ``python -m rollout_sync.tiny KIND PATH [--seed N]`` builds one.

``make_tiny_model(kind, path, seed)`` writes a Hugging Face checkpoint directory (config, bf16 safetensors,
a word-level tokenizer) that both DeepSpeed (through ``transformers``) and vLLM load. The shapes are chosen
so that every layout feature the sync must handle shows up at a tiny size:

- vocab 1000, not a multiple of 64, so that vLLM pads the embedding and ``lm_head`` rows;
- grouped-query attention (4 query heads, 2 KV heads, head_dim 32), so that vLLM's fused ``qkv_proj`` has
  unequal q, k and v blocks;
- ``dense`` and ``dense-tied`` differ only in ``tie_word_embeddings``;
- ``moe`` has 8 experts, top-2, ``moe_intermediate_size`` 64. transformers 5.19 holds the experts fused in
  memory but ``save_pretrained`` writes per-expert keys (``mlp.experts.{e}.gate_proj.weight``); those saved
  keys are the logical tensors.

Every weight is drawn from a seeded generator (matrices from N(0, 0.5), norms from 1 + N(0, 0.1)), so that
greedy decoding is not degenerate, norms differ between seeds, and the same seed gives the same bytes. A
second seed gives a second checkpoint of the same architecture.

A build is stamped (``rollout_sync_tiny.json``); calling again with the same kind and seed on the same path
returns at once. Builds go to a temporary sibling directory that is renamed into place, so concurrent
callers never see half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch

TinyKind = Literal["dense", "dense-tied", "moe"]
TINY_KINDS: tuple[TinyKind, ...] = get_args(TinyKind)

_STAMP = "rollout_sync_tiny.json"
# Bump when the recipe changes, so that a stale cached build is rebuilt rather than reused.
_RECIPE_VERSION = 1
_SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of one tiny model kind. ``vocab_size`` counts the special tokens."""

    kind: TinyKind
    vocab_size: int = 1000
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    max_position_embeddings: int = 512

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def tiny_spec(kind: TinyKind) -> TinyModelSpec:
    """The architecture of ``kind``; raises ``ValueError`` for an unknown kind."""
    if kind == "dense":
        return TinyModelSpec(kind=kind)
    if kind == "dense-tied":
        return TinyModelSpec(kind=kind, tie_word_embeddings=True)
    if kind == "moe":
        return TinyModelSpec(kind=kind, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    raise ValueError(f"unknown tiny model kind {kind!r}: expected one of {TINY_KINDS}")


def make_tiny_model(kind: TinyKind, path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build (or reuse) the tiny checkpoint ``kind`` drawn with ``seed`` in directory ``path``; return it.

    Deterministic: the same kind and seed give the same tensors bit for bit. Refuses (``FileExistsError``)
    to overwrite a directory that holds something other than a tiny build, and rebuilds a directory that
    holds a tiny build of another kind, seed or recipe version.
    """
    spec = tiny_spec(kind)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, found {seed!r}")
    stamp = {"kind": kind, "seed": seed, "recipe_version": _RECIPE_VERSION, "spec": asdict(spec)}
    return build_stamped(Path(path), _STAMP, stamp, lambda out: _build(spec, seed, out))


def build_stamped(
    target: Path, stamp_file: str, stamp: dict[str, Any], build: Callable[[Path], None]
) -> Path:
    """``target`` if it holds ``stamp`` (in its file ``stamp_file``); else ``build(directory)`` into a
    temporary sibling, stamped and renamed into place (a concurrent build of the same stamp wins). Refuses
    (``FileExistsError``) a non-empty ``target`` without the stamp file: it is not a build of ours."""
    existing = _read_stamp(target, stamp_file)
    if existing == stamp:
        return target
    if target.exists() and any(target.iterdir()) and existing is None:
        raise FileExistsError(
            f"{target} is not empty and holds no model stamp ({stamp_file}); refusing to overwrite it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        (staging / stamp_file).write_text(json.dumps(stamp, indent=1, sort_keys=True))
        if _read_stamp(target, stamp_file) == stamp:  # another process finished the same build first
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _read_stamp(path: Path, stamp_file: str = _STAMP) -> dict[str, Any] | None:
    try:
        data = json.loads((path / stamp_file).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _hf_config(spec: TinyModelSpec) -> Any:
    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
    }
    if spec.is_moe:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def _build(spec: TinyModelSpec, seed: int, out: Path) -> None:
    import torch

    config = _hf_config(spec)
    if spec.is_moe:
        from transformers import Qwen3MoeForCausalLM as model_cls
    else:
        from transformers import Qwen3ForCausalLM as model_cls  # type: ignore[assignment]
    with torch.device("cpu"):
        model = model_cls(config)
    _redraw(model, seed)
    torch.nn.Module.to(model, dtype=torch.bfloat16)  # transformers types its own `to` oddly
    model.config.dtype = "bfloat16"
    model.save_pretrained(out)
    _save_tokenizer(spec, out)


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in ``named_parameters`` order (which is fixed
    by the architecture), so the result does not depend on transformers' own initialisers."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * draw)
            else:
                param.copy_(0.5 * draw)


def _save_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(spec.vocab_size - len(_SPECIAL_TOKENS))]
    vocab = {tok: i for i, tok in enumerate((*_SPECIAL_TOKENS, *words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
    )
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m rollout_sync.tiny", description="Build a tiny Qwen3 checkpoint locally (no download)."
    )
    parser.add_argument("kind", choices=TINY_KINDS)
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_model(args.kind, args.path, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
