"""Export round trip: an in-memory module -> HF directory -> transformers and fmoe_jax load it and agree."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from fmoe_jax.models import build_model, config_from_hf

import fmoe_jax as fj
from fmoe_jax.checkpoint.hf import SafetensorsFile
from fmoe_jax.export import export_hf, flat_params

_BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
CONFIGS = {
    "mixtral": dict(
        _BASE,
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    ),
    "qwen2_moe": dict(
        _BASE,
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        intermediate_size=40,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        mlp_only_layers=[1],  # a dense layer too
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        _BASE,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=40,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        mlp_only_layers=[],
        tie_word_embeddings=True,
    ),
    "deepseek_v2": dict(
        _BASE,
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        num_key_value_heads=4,
        intermediate_size=40,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        kv_lora_rank=16,
        q_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        tie_word_embeddings=False,
    ),
}
TOKENS = np.random.default_rng(0).integers(3, 96, size=(2, 11)).astype(np.int32)


def random_module(hf: dict, seed: int = 0):
    """A module with every parameter random (norm weights and biases too, so a mapping error shows)."""
    module = build_model(config_from_hf(hf), seed=seed)
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        (1.0 if x.ndim == 1 else 0.0) + 0.2 * jax.random.normal(k, x.shape, x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


def hf_logits(directory) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_float32_export_loads_in_transformers_and_fmoe_jax_with_the_same_logits(family, tmp_path):
    hf = CONFIGS[family]
    module = random_module(hf)
    export_hf(module, hf, tmp_path, dtype="float32")
    want = np.asarray(fj.forward(fj.from_module(module), TOKENS))
    np.testing.assert_allclose(hf_logits(tmp_path), want, rtol=1e-4, atol=1e-4)

    loaded = fj.load_model(tmp_path)
    assert loaded.config == module.config
    original, reloaded = flat_params(module), flat_params(loaded.module)
    assert original.keys() == reloaded.keys()
    for path, value in original.items():
        np.testing.assert_array_equal(reloaded[path], value, err_msg=str(path))
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 1


def test_bfloat16_export_stores_rounded_weights(tmp_path):
    hf = CONFIGS["qwen2_moe"]
    module = random_module(hf, seed=1)
    export_hf(module, hf, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    entries = SafetensorsFile(tmp_path / "model.safetensors").entries
    assert {dtype for dtype, *_ in entries.values()} == {np.dtype(ml_dtypes.bfloat16)}
    loaded = fj.load_model(tmp_path, dtype="float32")
    for path, value in flat_params(module).items():
        rounded = value.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(flat_params(loaded.module)[path], rounded, err_msg=str(path))
    logits = np.asarray(fj.forward(loaded, TOKENS))
    np.testing.assert_allclose(hf_logits(tmp_path), logits, rtol=1e-4, atol=1e-4)


def test_tokenizer_and_model_card_are_written(tmp_path):
    from fmoe_jax.research.tokenizer import load_tokenizer, train_bpe_tokenizer
    from transformers import AutoTokenizer

    train_bpe_tokenizer(["the quick brown fox jumps\n"] * 20, 280, tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    hf = CONFIGS["mixtral"]
    out = export_hf(
        random_module(hf),
        hf,
        tmp_path / "out",
        tokenizer=tokenizer,
        readme="# card\n",
        extra_json={"x.json": [1]},
    )
    reloaded = AutoTokenizer.from_pretrained(str(out))
    assert reloaded("the quick fox")["input_ids"] == tokenizer("the quick fox")["input_ids"]
    assert (out / "README.md").read_text() == "# card\n"
    assert json.loads((out / "x.json").read_text()) == [1]
    assert fj.load_model(out).tokenizer is not None


def test_export_refuses_a_config_the_module_was_not_built_from(tmp_path):
    module = random_module(CONFIGS["mixtral"])
    with pytest.raises(ValueError, match="num_experts"):
        export_hf(module, dict(CONFIGS["mixtral"], num_local_experts=8), tmp_path)
    # transformers' Mixtral default rope_theta is 1e6; a module built assuming 1e4 must not be exported as it
    no_theta = {k: v for k, v in CONFIGS["mixtral"].items() if k != "rope_theta"}
    with pytest.raises(ValueError, match="rope"):
        export_hf(module, no_theta, tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_hf(module, CONFIGS["mixtral"], tmp_path, dtype="int8")
    assert not any(tmp_path.iterdir())
