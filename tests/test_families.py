"""What parity with transformers cannot show for Qwen3-MoE, OLMoE, DeepSeek-V2 and the issue-55 families:
attributes refused by name, DeepSeek-V2 routing where transformers 5.23 departs from DeepSeek's code,
DeepSeek-V3's group-limited sigmoid routing against a transcription of DeepSeek's gate, Kimi-K2 read as
DeepSeek-V3, and the size of the MLA cache."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import HF_CONFIGS
from fmoe_jax.models import UnsupportedConfigError, config_from_hf, init_kv_cache
from fmoe_jax.models.deepseek_v2 import deepseek_topk
from fmoe_jax.models.deepseek_v3 import sigmoid_topk

YARN = HF_CONFIGS["deepseek_v2"]["rope_parameters"]


def hf(name: str, **changes) -> dict:
    model_type = {"deepseek_v2_lite": "deepseek_v2"}.get(name, name)
    return {**HF_CONFIGS[name], "model_type": model_type, **changes}


@pytest.mark.parametrize(
    "name, changes, named",
    [
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64), "use_sliding_window=True"),
        ("qwen3_moe", dict(attention_bias=True), "attention_bias=True"),
        ("olmoe", dict(head_dim=32), "head_dim=32"),
        ("olmoe", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope type 'yarn'"),
        ("deepseek_v2", dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
        ("deepseek_v2", dict(moe_layer_freq=2), "moe_layer_freq=2"),
        ("deepseek_v2", dict(num_key_value_heads=2), "num_key_value_heads=2"),
        (
            "deepseek_v2",
            dict(
                rope_parameters={**HF_CONFIGS["deepseek_v2"]["rope_parameters"], "partial_rotary_factor": 0.5}
            ),
            "partial_rotary_factor",
        ),
        ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
        ("deepseek_v3", dict(topk_method="greedy"), "topk_method='greedy'"),
        ("deepseek_v3", dict(attention_bias=True), "attention_bias=True"),
        ("glm4_moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("glm4_moe", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "partial rotary factor"),
        ("gpt_oss", dict(layer_types=["sliding_attention", "chunked_attention"]), "chunked_attention"),
    ],
)
def test_unimplemented_attributes_are_refused_by_name(name, changes, named):
    with pytest.raises(UnsupportedConfigError, match=named):
        config_from_hf(hf(name, **changes))


def deepseek_v2_gate(logits: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V2's MoEGate (inference) transcribed in NumPy: ids sorted per row, and their weights."""
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    if cfg.topk_method == "group_limited_greedy":
        n, j = scores.shape
        group_scores = scores.reshape(n, cfg.n_group, -1).max(-1)
        groups = np.argsort(-group_scores, axis=-1)[:, : cfg.topk_group]
        mask = np.zeros_like(group_scores)
        np.put_along_axis(mask, groups, 1.0, axis=-1)
        scores = np.where(np.repeat(mask, j // cfg.n_group, axis=1) > 0, scores, 0.0)
    ids = np.argsort(-scores, axis=-1)[:, : cfg.top_k]
    weights = np.take_along_axis(scores, ids, -1)
    if cfg.top_k > 1 and cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v2"])
def test_deepseek_routing_follows_deepseek_v2_code(name, norm_topk_prob):
    """transformers 5.23 ignores `norm_topk_prob` (it always scales by `routed_scaling_factor`); DeepSeek-V2's
    code renormalises instead when it is set. Both shapes, greedy and group-limited."""
    cfg = config_from_hf(hf(name, norm_topk_prob=norm_topk_prob))
    logits = np.random.default_rng(0).normal(0, 2, (64, cfg.num_experts)).astype(np.float32)
    routing = deepseek_topk(logits, cfg)
    ids, weights = np.asarray(routing.ids), np.asarray(routing.weights)
    order = np.argsort(ids, axis=-1)
    want_ids, want_weights = deepseek_v2_gate(logits.astype(np.float64), cfg)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, -1), want_ids)
    np.testing.assert_allclose(np.take_along_axis(weights, order, -1), want_weights, rtol=1e-5, atol=1e-7)
    if norm_topk_prob:
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    if cfg.topk_method == "group_limited_greedy":  # picks fall in at most topk_group groups
        groups = ids // (cfg.num_experts // cfg.n_group)
        assert max(len(set(row)) for row in groups.tolist()) <= cfg.topk_group


def test_mla_cache_holds_the_latent_and_the_shared_rope_key():
    cfg = config_from_hf(hf("deepseek_v2_lite"))
    cache = init_kv_cache(cfg, 2, 40, np.float32)
    assert len(cache) == cfg.num_layers
    assert cache[0].k.shape == (2, 40, 1, cfg.kv_lora_rank)
    assert cache[0].v.shape == (2, 40, 1, cfg.qk_rope_head_dim)
    assert cfg.moe_layers == (False, True, True) and cfg.shared_expert_intermediate_size == 2 * 24


def deepseek_v3_gate(logits: np.ndarray, bias: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's Gate (sigmoid scoring, `noaux_tc`) transcribed in NumPy, float64: ids sorted per row,
    and their weights."""
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias
    n, j = scores.shape
    grouped = np.sort(choice.reshape(n, cfg.n_group, -1), axis=-1)[..., -2:].sum(-1)  # two best per group
    keep = np.argsort(-grouped, axis=-1)[:, : cfg.topk_group]
    mask = np.zeros_like(grouped, bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    choice = np.where(np.repeat(mask, j // cfg.n_group, axis=1), choice, -np.inf)
    ids = np.sort(np.argsort(-choice, axis=-1)[:, : cfg.top_k], axis=-1)
    weights = np.take_along_axis(scores, ids, -1)
    weights = weights / weights.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    return ids, weights


def test_deepseek_v3_routing_follows_deepseek_code():
    """Groups ranked by their two best corrected scores (not their best one, as V2), experts chosen with the
    correction bias and weighted without it; the bias is large enough to change some choices."""
    cfg = config_from_hf(hf("deepseek_v3"))
    assert (cfg.n_group, cfg.topk_group, cfg.score_correction_bias) == (4, 2, True)
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (64, cfg.num_experts)).astype(np.float32)
    bias = rng.normal(0, 0.2, cfg.num_experts).astype(np.float32)
    routing = sigmoid_topk(logits, cfg, bias)
    ids, weights = np.asarray(routing.ids), np.asarray(routing.weights)
    order = np.argsort(ids, axis=-1)
    want_ids, want_weights = deepseek_v3_gate(logits.astype(np.float64), bias.astype(np.float64), cfg)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, -1), want_ids)
    np.testing.assert_allclose(np.take_along_axis(weights, order, -1), want_weights, rtol=1e-5, atol=1e-7)
    unbiased = np.asarray(sigmoid_topk(logits, cfg, np.zeros_like(bias)).ids)
    assert (np.sort(unbiased, -1) != want_ids).any()


def test_kimi_k2_is_read_as_deepseek_v3():
    config = hf("deepseek_v3", model_type="kimi_k2", n_group=1, topk_group=1)
    cfg = config_from_hf(config)
    assert cfg.family == "deepseek_v3" and cfg.router == "sigmoid_grouped" and cfg.n_group == 1


def test_glm_rotates_half_of_each_head_by_default():
    config = {k: v for k, v in hf("glm4_moe").items() if k != "rope_parameters"}
    cfg = config_from_hf(config)
    assert (cfg.head_dim, cfg.rope_dim) == (32, 16) and cfg.qk_norm == "head" and cfg.qkv_bias
