"""Qwen3-Next and Qwen3.5-MoE beyond parity with transformers (tests/test_parity.py runs their tiny models
against it): the chunked prefill against the token-by-token recurrence, padding and a fresh start leaving a
linear layer's state alone, attributes refused by name, conversion of a vision-language checkpoint, and
continuous batching giving each request what it gets alone. Offloading them is lossless:
tests/test_lossless.py (every policy, 1 slot and 25 %), test_hybrid.py (host execution),
test_quant_lossless.py (int8 / int4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_CONFIGS, QWEN35_VISION
from flax import nnx
from fmoe_jax.convert.cli import main as convert_main
from fmoe_jax.models import LinearState, UnsupportedConfigError, config_from_hf, init_kv_cache
from fmoe_jax.models.gated_deltanet import GatedDeltaNet, chunked_delta_rule, delta_rule_step, l2_normalize
from fmoe_jax.models.layers import Layout
from fmoe_jax.offload.cost_model import ModelPreset
from test_batching import serve as serve_batch

import fmoe_jax as fj
from fmoe_jax.batching import ContinuousBatch
from fmoe_jax.generation import resolve_request


def delta_inputs(rng, b: int, t: int, h: int, dk: int, dv: int):
    """Queries, keys, values, log decays, rates and a state as the layer makes them (float32)."""
    q = l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) * dk**-0.5
    k = l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    g = -jax.nn.softplus(jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32))  # decays in (0, 1)
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32))
    g, beta = g.at[:, :5].set(0.0), beta.at[:, :5].set(0.0)  # left padding: no decay, no write
    state = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32) * 0.3
    return q, k, v, g, beta, state


@jax.jit
def recurrence(q, k, v, g, beta, state):
    """The delta rule one token at a time (`delta_rule_step` under a scan over T)."""

    def step(s, xs):
        out, s = delta_rule_step(*xs, s)
        return s, out

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


@pytest.mark.parametrize("chunk", [64, 16])
def test_chunked_prefill_equals_the_recurrence(chunk):
    """150 tokens (not a multiple of the chunk: the last chunk is padded with no-op tokens), from a non-zero
    state, five padding tokens first: outputs and final state within 1e-5 of the token-by-token rule."""
    q, k, v, g, beta, state = delta_inputs(np.random.default_rng(0), 2, 150, 4, 16, 24)
    want_out, want_state = recurrence(q, k, v, g, beta, state)
    out, final = jax.jit(chunked_delta_rule, static_argnums=6)(q, k, v, g, beta, state, chunk)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), np.asarray(want_state), rtol=0, atol=1e-5)
    assert float(jnp.max(jnp.abs(want_out))) > 0.1  # four orders of magnitude above the tolerance


@nnx.jit
def run_layer(layer, x, cache: LinearState, layout: Layout):
    return layer(x, None, cache, layout, None)


def layout(write: int, key_start: int, active: bool, t: int) -> Layout:
    return Layout(jnp.int32(write), jnp.asarray([key_start], jnp.int32), jnp.asarray([active]), t)


def test_padding_and_a_fresh_start_leave_the_linear_state_alone():
    """One linear layer of the tiny Qwen3-Next, float32: a row left padded by 12 positions ends its prefill
    with the state (and outputs) it has unpadded, though its cache held another request's state (a call that
    starts a row's sequence ignores it); a finished row's decode step changes nothing of its state."""
    cfg = config_from_hf(hf("qwen3_next"))
    layer = GatedDeltaNet(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    fresh = init_kv_cache(cfg, 1, 4, jnp.float32)[0]
    dirty = LinearState(jnp.full_like(fresh.conv, 0.5), jnp.full_like(fresh.recurrent, 0.5))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, 20, cfg.hidden_size)), jnp.float32)
    garbage = jnp.asarray(np.random.default_rng(6).normal(size=(1, 12, cfg.hidden_size)), jnp.float32)
    out, alone = run_layer(layer, x, fresh, layout(0, 0, True, 20))
    padded_x = jnp.concatenate([garbage, x], axis=1)
    out_padded, padded = run_layer(layer, padded_x, dirty, layout(0, 12, True, 32))
    np.testing.assert_allclose(np.asarray(out_padded[:, 12:]), np.asarray(out), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(padded.recurrent), np.asarray(alone.recurrent), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(padded.conv), np.asarray(alone.conv), rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(alone.recurrent))) > 0.01

    _, after = run_layer(layer, x[:, :1], padded, layout(32, 12, False, 1))  # a finished row
    np.testing.assert_array_equal(np.asarray(after.recurrent), np.asarray(padded.recurrent))
    np.testing.assert_array_equal(np.asarray(after.conv), np.asarray(padded.conv))
    _, carried = run_layer(layer, x[:, :1], padded, layout(32, 12, True, 1))  # a live row carries on
    assert not np.allclose(np.asarray(carried.recurrent), np.asarray(padded.recurrent))


def hf(name: str, **changes) -> dict:
    config = {**HF_CONFIGS[name], "model_type": name, **changes}
    if name == "qwen3_5_moe":  # as it ships: the text config nested in a vision-language one
        return {"model_type": name, "text_config": {**config, "model_type": "qwen3_5_moe_text"}}
    return config


@pytest.mark.parametrize(
    "name, changes, named",
    [
        ("qwen3_next", dict(attention_bias=True), "attention_bias=True"),
        ("qwen3_next", dict(attn_output_gate=False), "attn_output_gate=False"),
        ("qwen3_next", dict(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype='bfloat16'"),
        ("qwen3_next", dict(layer_types=["linear_attention"] * 3 + ["sliding"]), "'sliding'"),
        ("qwen3_next", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        ("qwen3_5_moe", dict(norm_topk_prob=False), "norm_topk_prob=False"),
        ("qwen3_5_moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1]"),
    ],
)
def test_unimplemented_attributes_are_refused_by_name(name, changes, named):
    with pytest.raises(UnsupportedConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        config_from_hf(hf(name, **changes))


def test_layer_kinds_and_defaults_follow_transformers():
    """No `layer_types`: every fourth layer full attention (`full_attention_interval`); no
    `partial_rotary_factor`: a quarter of each head rotates; Qwen3.5's text model alone reads the same."""
    base = {k: v for k, v in hf("qwen3_next").items() if k != "layer_types"}
    cfg = config_from_hf({**base, "num_hidden_layers": 8, "mlp_only_layers": []})
    assert cfg.linear_attention.layers == (True, True, True, False) * 2
    assert cfg.rope_dim == 8 and cfg.attention_output_gate and cfg.norm == "rms_zero_centered"
    text = config_from_hf({**HF_CONFIGS["qwen3_5_moe"], "model_type": "qwen3_5_moe_text"})
    assert text == config_from_hf(hf("qwen3_5_moe")) and text.family == "qwen3_5_moe"
    assert not text.linear_attention.fused_projections and cfg.linear_attention.fused_projections
    assert [ModelPreset.from_config(c).linear_layers for c in (cfg, text)] == [6, 3]


def test_conversion_leaves_out_the_vision_tower_with_a_note(hf_dirs, tmp_path, capsys):
    """The Qwen3.5 checkpoint as it ships (vision tower and all): `fmoe-convert` converts the text model,
    says in one line what it left out, and the result loads with the same logits as the checkpoint itself."""
    assert convert_main([str(hf_dirs["qwen3_5_moe"]), str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "qwen3_5_moe" in lines[0], lines
    assert lines[1].startswith("not converted: vision tower (") and "multi-token" not in lines[1], lines
    ids = np.random.default_rng(2).integers(0, 256, (1, 24))
    converted = fj.forward(fj.load_model(tmp_path / "out"), ids)
    direct = fj.forward(fj.load_model(hf_dirs["qwen3_5_moe"]), ids)
    np.testing.assert_array_equal(np.asarray(converted), np.asarray(direct))
    assert QWEN35_VISION["depth"] == 1  # the note counts the tiny tower conftest builds


def test_continuous_batching_gives_each_request_what_it_gets_alone(hf_dirs):
    """Four requests share three slots of an offloaded bfloat16 Qwen3.5 (fmoe, a quarter of the experts),
    joining every other iteration: each slot's linear state is reset when it takes a new request, and each
    request gets, bit for bit, the tokens and log-probabilities it gets served alone."""
    offload = fj.OffloadConfig(policy="fmoe", cache_experts=16, prefetch_distance=1)
    model = fj.load_model(hf_dirs["qwen3_5_moe"], dtype="bfloat16", offload=offload)
    try:
        batch = ContinuousBatch(model, slots=3, context=64, chunk=16)
        rng = np.random.default_rng(7)
        requests = [
            resolve_request(
                model,
                [rng.integers(3, 256, n).tolist()],
                max_new_tokens=4 + 2 * i,
                return_logprobs=True,
                stop_at_eos=False,
            )
            for i, n in enumerate((5, 20, 33, 9))
        ]
        alone = [serve_batch(batch, [r]) for r in requests]
        together = serve_batch(batch, requests, join_every=2)
        for i, request in enumerate(requests):
            assert together[0][i] == alone[i][0][0], i
            assert together[1][i] == alone[i][1][0], i  # float equality: bit for bit
            assert len(together[0][i]) == request.max_new_tokens
    finally:
        model.close()
