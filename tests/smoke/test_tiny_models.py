"""The tiny checkpoints: deterministic per seed, distinct across seeds, shaped to show every layout feature
(vocab padding, GQA, tied embeddings, per-expert MoE keys), and not degenerate under greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.tiny_models import make_tiny_model, tiny_spec

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(path / "model.safetensors"))


def test_the_same_seed_gives_the_same_tensors_bit_for_bit(tmp_path, tiny_model):
    again = make_tiny_model("moe", tmp_path / "moe-again", seed=0)
    first, second = _tensors(tiny_model("moe", 0)), _tensors(again)
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor.view(torch.int16), second[name].view(torch.int16)), name


def test_a_second_seed_gives_another_checkpoint_of_the_same_architecture(tiny_model):
    first, second = _tensors(tiny_model("dense", 0)), _tensors(tiny_model("dense", 1))
    assert {k: v.shape for k, v in first.items()} == {k: v.shape for k, v in second.items()}
    differing = [name for name in first if not torch.equal(first[name], second[name])]
    assert differing == sorted(first), "every tensor, norms included, must differ between seeds"


def test_the_dense_checkpoint_has_an_unpadded_vocab_and_gqa_shapes(tiny_model):
    tensors = _tensors(tiny_model("dense"))
    assert tensors["model.embed_tokens.weight"].shape == (1000, 128)
    assert tensors["lm_head.weight"].shape == (1000, 128)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 128)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (128, 256)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_the_tied_checkpoint_saves_no_lm_head(tiny_model):
    path = tiny_model("dense-tied")
    assert "lm_head.weight" not in _tensors(path)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True


def test_the_moe_checkpoint_saves_one_key_per_expert_and_projection(tiny_model):
    tensors = _tensors(tiny_model("moe"))
    spec = tiny_spec("moe")
    for layer in range(spec.num_hidden_layers):
        for expert in range(spec.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}"
            assert tensors[f"{prefix}.gate_proj.weight"].shape == (64, 128)
            assert tensors[f"{prefix}.up_proj.weight"].shape == (64, 128)
            assert tensors[f"{prefix}.down_proj.weight"].shape == (128, 64)
        assert tensors[f"model.layers.{layer}.mlp.gate.weight"].shape == (8, 128)


def test_a_directory_holding_something_else_is_not_overwritten(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        make_tiny_model("dense", tmp_path, seed=0)
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_an_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        make_tiny_model("llama", tmp_path / "x", seed=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_decoding_of_the_tiny_model_is_not_degenerate(tiny_model, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model(kind)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompt = tokenizer("w1 w2 w3 w4 w5", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    new_tokens = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(set(new_tokens)) >= 6, new_tokens
