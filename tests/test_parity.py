"""Parity of fmoe_jax with transformers on tiny random models of every family (float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import HF_CONFIGS, make_hf_model
from fmoe_jax.models import Layout

import fmoe_jax as fj
from fmoe_jax.generation import bucket_length

NAMES = list(HF_CONFIGS)


@pytest.fixture
def original_longrope(monkeypatch):
    """Makes transformers' Phi-3.5-MoE rotary embedding follow the original model code.

    transformers 5.23 computes `inv_freq` with `rope_init_fn(config)` and no sequence length, so its
    Phi-MoE always uses the *short* LongRoPE factors (only the mscale switches). The original
    Phi-3.5-MoE code, and fmoe_jax, switch to the long factors once the sequence exceeds
    `original_max_position_embeddings`. The reference is corrected here, in the test only.
    """
    from transformers.models.phimoe import modeling_phimoe

    def forward(self, x, position_ids):
        seq_len = int(position_ids.max()) + 1
        params = self.config.rope_parameters
        inv_freq, _ = self.rope_init_fn(self.config, x.device, seq_len=seq_len)
        long = seq_len > params["original_max_position_embeddings"]
        mscale = params["long_mscale"] if long else params["short_mscale"]
        freqs = position_ids[..., None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * mscale).to(x.dtype), (emb.sin() * mscale).to(x.dtype)

    monkeypatch.setattr(modeling_phimoe.PhimoeRotaryEmbedding, "forward", forward)


def hf_logits_and_probs(model, ids: np.ndarray):
    with torch.no_grad():
        out = model(torch.tensor(ids), output_router_logits=True)
    probs = [torch.softmax(r.float(), dim=-1).numpy() for r in out.router_logits]
    return out.logits.numpy(), np.stack(probs, axis=1).reshape(*ids.shape, len(probs), -1)


@pytest.mark.parametrize("name", NAMES)
def test_long_prompt_logits_and_router_probs(name, hf_dirs, original_longrope):
    """A 320-token prompt (beyond Phi's original_max_position_embeddings=64 and Mixtral's window of 48)."""
    hf = make_hf_model(name)
    ids = np.random.default_rng(1).integers(0, HF_CONFIGS[name]["vocab_size"], (1, 320))
    ref_logits, ref_probs = hf_logits_and_probs(hf, ids)
    model = fj.load_model(hf_dirs[name])
    logits, probs = fj.forward(model, ids, return_router_probs=True)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(probs), ref_probs, rtol=0, atol=1e-5)


def test_phi_long_factors_matter(hf_dirs, original_longrope):
    """The long-factor branch is really taken: the same prompt differs from a short-only rotation."""
    model = fj.load_model(hf_dirs["phimoe"])
    ids = np.random.default_rng(2).integers(0, 256, (1, 100))
    ours = np.asarray(fj.forward(model, ids))
    hf = make_hf_model("phimoe")
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
    cfg = model.config
    import dataclasses

    short_only = dataclasses.replace(cfg.rope, long_factor=cfg.rope.short_factor)
    from fmoe_jax.models.layers import rope_tables

    pos = jnp.arange(100)[None]
    valid = jnp.ones((1, 100), bool)
    long_cos, _ = rope_tables(cfg.rope, cfg.head_dim, pos, valid, jnp.float32)
    short_cos, _ = rope_tables(short_only, cfg.head_dim, pos, valid, jnp.float32)
    assert float(jnp.max(jnp.abs(long_cos - short_cos))) > 0.1


# `test_prefill_then_decode_equals_full_forward` steps at the shapes `test_greedy_batch_matches_hf_generate`'s
# `generate` call compiles (two rows, the longer prompt bucketed, a cache for it and the new tokens), so that
# each family's step programs compile once for both tests (the same program of another load is a cache hit).
GREEDY_LENGTHS, GREEDY_NEW_TOKENS = (37, 90), 32
PROMPT_BUCKET = bucket_length(max(GREEDY_LENGTHS))
CACHE_LEN = bucket_length(PROMPT_BUCKET + GREEDY_NEW_TOKENS)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_equals_full_forward(name, hf_dirs):
    """A 96-token prefill (past Mixtral's window of 48, Phi's original 64 positions), 16 decode steps."""
    assert PROMPT_BUCKET > 64  # the prefill crosses both
    model = fj.load_model(hf_dirs[name])
    length = PROMPT_BUCKET + 16
    ids = np.random.default_rng(3).integers(0, 256, (2, length)).astype(np.int32)
    full = np.asarray(fj.forward(model, ids))  # [B, T, V]
    engine = model.engine
    prompt = PROMPT_BUCKET
    cache = engine.init_cache(2, CACHE_LEN)
    key = jax.random.key(0)
    layout = Layout(jnp.int32(0), jnp.zeros((2,), jnp.int32), jnp.ones((2,), bool), prompt)
    out, cache = engine.step(jnp.asarray(ids[:, :prompt]), cache, layout, key, fj.Greedy())
    np.testing.assert_allclose(np.asarray(out.logits), full[:, prompt - 1], rtol=0, atol=1e-5)
    for t in range(prompt, length):
        layout = Layout(jnp.int32(t), jnp.zeros((2,), jnp.int32), jnp.ones((2,), bool), 1)
        out, cache = engine.step(jnp.asarray(ids[:, t : t + 1]), cache, layout, key, fj.Greedy())
        np.testing.assert_allclose(np.asarray(out.logits), full[:, t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_batch_matches_hf_generate(name, hf_dirs, original_longrope):
    """Two prompts of different lengths in one left-padded batch; each matches HF generating it alone."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, n).tolist() for n in GREEDY_LENGTHS]
    model = fj.load_model(hf_dirs[name])
    out = fj.generate(model, prompts, max_new_tokens=GREEDY_NEW_TOKENS, stop_at_eos=False)
    assert model.engine.programs.compilations.keys() == {
        f"whole_step_T{PROMPT_BUCKET}_S{CACHE_LEN}_B2",
        f"whole_step_T1_S{CACHE_LEN}_B2",
    }  # the programs the test before compiled (see PROMPT_BUCKET)
    hf = make_hf_model(name)
    for prompt, ours in zip(prompts, out.tokens, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False)
        assert ours == ref[0, len(prompt) :].tolist()


def test_decode_loop_does_not_recompile(hf_dirs):
    model = fj.load_model(hf_dirs["mixtral"])
    compiled = model.engine.programs.compilations  # this model's own programs, counted by label
    fj.generate(model, [[5, 6, 7, 8, 1]], max_new_tokens=21, stop_at_eos=False)
    assert sum(compiled.values()) == 2  # one prefill and one decode program
    counts = dict(compiled)
    fj.generate(model, [[9, 10, 11]], max_new_tokens=20, stop_at_eos=False)
    assert dict(compiled) == counts  # same buckets: nothing new is compiled
