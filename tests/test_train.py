"""Tests for fmoe_jax.research.train: the blocked training kernel, the HF load-balancing loss, data, loss,
resume."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from fmoe_jax.models import ExpertWeights, Routing, expert_mixture, reference_mixture
from fmoe_jax.research import train, workloads

TINY_MIXTRAL = dict(
    model_type="mixtral",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    router_aux_loss_coef=0.01,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def _experts(n: int, d: int, f: int, seed: int) -> list[ExpertWeights]:
    rng = np.random.default_rng(seed)
    return [
        ExpertWeights(*(jnp.asarray(rng.normal(0, 0.3, s), jnp.float32) for s in ((f, d), (f, d), (d, f))))
        for _ in range(n)
    ]


def test_blocked_kernel_matches_reference_in_value_and_gradient():
    n, d, f, j, k = 37, 8, 12, 5, 2  # 74 assignments over 5 experts: several tiles, some partly filled
    rng = np.random.default_rng(0)
    experts = _experts(j, d, f, 1)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(n, j)) * 2, jnp.float32)

    def mix(kernel, experts, x):
        probs = jax.nn.softmax(logits, axis=-1)
        weights, ids = jax.lax.top_k(probs, k)
        routing = Routing(probs, ids.astype(jnp.int32), weights)
        if kernel == "reference":
            return reference_mixture(x, routing, experts)
        return expert_mixture(
            x, routing, experts, jnp.arange(j, dtype=jnp.int32), jnp.ones(n, bool), kernel=kernel
        )

    np.testing.assert_allclose(mix("blocked", experts, x), mix("reference", experts, x), rtol=1e-5, atol=1e-5)
    grads = {
        kernel: jax.grad(lambda e, x, kernel=kernel: jnp.sum(jnp.sin(mix(kernel, e, x))), argnums=(0, 1))(
            experts, x
        )
        for kernel in ("blocked", "reference")
    }
    for got, want in zip(jax.tree.leaves(grads["blocked"]), jax.tree.leaves(grads["reference"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_load_balancing_loss_matches_transformers():
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(24, 6)).astype(np.float32) * s for s in (0.5, 2.0, 4.0)]  # 3 layers
    want = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), num_experts=6, top_k=2)
    got = train.load_balancing_loss([jax.nn.softmax(jnp.asarray(x), axis=-1) for x in logits], top_k=2)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-6)


def fake_tokenizer(encode) -> SimpleNamespace:
    """A stand-in with the one method training code uses: `backend_tokenizer.encode(text).ids/.offsets`."""
    return SimpleNamespace(
        backend_tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens=False: encode(text))
    )


def test_sampler_rows_start_with_bos_then_a_line_start_and_are_deterministic():
    vocab = {
        "\n": 3,
        "alpha": 4,
        "beta": 5,
        "gamma": 6,
        "delta": 7,
        "epsilon": 8,
        "zeta": 9,
        "x": 10,
        "y": 11,
    }

    def encode(text):
        spans = [m.span() for m in re.finditer(r"\n|[^\s]+", text)]
        return SimpleNamespace(ids=[vocab[text[a:b]] for a, b in spans], offsets=spans)

    texts = {"a": "alpha beta\ngamma delta epsilon\nzeta\n" * 20, "b": "x y\n" * 30}
    sampler = train.TokenSampler.from_texts(fake_tokenizer(encode), texts)
    batch = sampler.batch(seed=3, step=7, batch_size=32, seq_len=6)
    assert batch.shape == (32, 6) and (batch[:, 0] == train.BOS_ID).all()
    assert set(batch[:, 1].tolist()) <= {vocab["alpha"], vocab["gamma"], vocab["zeta"], vocab["x"]}
    np.testing.assert_array_equal(batch, sampler.batch(seed=3, step=7, batch_size=32, seq_len=6))
    assert not np.array_equal(batch, sampler.batch(seed=3, step=8, batch_size=32, seq_len=6))


def _pattern_sampler() -> train.TokenSampler:
    rng = np.random.default_rng(0)
    phrases = [rng.integers(4, 64, size=rng.integers(3, 8)) for _ in range(6)]
    stream = np.concatenate([phrases[i] for i in rng.integers(0, 6, size=400)]).astype(np.int32)
    return train.TokenSampler({"d": stream}, {"d": np.arange(0, len(stream), 5)})


def test_loss_decreases_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    cfg = train.TrainConfig(steps=8, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=1, checkpoint_every=3)
    sampler = _pattern_sampler()
    full = train.train(TINY_MIXTRAL, sampler, cfg, tmp_path / "full", progress=False)
    ce = [h["ce"] for h in full.history]
    assert full.finished and full.step == 8 and full.tokens_seen == 8 * 4 * 16
    assert np.mean(ce[-2:]) < ce[0] - 0.3, ce

    first = train.train(TINY_MIXTRAL, sampler, cfg, tmp_path / "split", stop_after=5, progress=False)
    assert first.step == 5 and not first.finished
    resumed = train.train(TINY_MIXTRAL, sampler, cfg, tmp_path / "split", progress=False)
    assert resumed.step == 8 and [h["ce"] for h in resumed.history] == ce
    states = [jax.tree.leaves(nnx.split(r.module)[1]) for r in (full, resumed)]
    for a, b in zip(*states, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    other = dataclasses.replace(cfg, lr=1e-3)
    with pytest.raises(ValueError, match="other settings"):
        train.train(TINY_MIXTRAL, sampler, other, tmp_path / "split", progress=False)


def test_held_out_nll_of_uniform_logits_is_log_vocab_and_unigram_baseline():
    chars = fake_tokenizer(lambda text: SimpleNamespace(ids=[ord(c) % 50 + 4 for c in text]))
    texts = {"x": "abcdefghij" * 10}
    uniform = lambda t: np.zeros((*t.shape, 54), np.float32)  # noqa: E731
    got = train.held_out_nll(uniform, chars, texts, seq_len=9, batch_size=4)
    assert got["x"]["tokens"] == 96  # 12 windows of 8 tokens, 4 left over
    np.testing.assert_allclose(got["x"]["nll"], np.log(54), rtol=1e-6)
    targets = got["x"]["targets"]
    # a unigram model of the same tokens: 10 equally frequent symbols, add-one smoothing over 54
    counts = np.full(10, 101.0)
    want = -np.log((counts[0]) / (counts.sum() + 44))
    np.testing.assert_allclose(
        train.unigram_nll(np.repeat(np.unique(targets), 100), targets, 54), want, rtol=1e-6
    )


def test_prepare_tokenizer_prepends_bos_and_is_reused(tmp_path):
    corpora = tmp_path / "corpora"
    corpora.mkdir()
    for i, name in enumerate(workloads.CORPUS_DOMAINS.values()):
        lines = [f"line {j} of corpus {i}: the quick brown fox {j * i} jumps" for j in range(200)]
        (corpora / name).write_text("\n".join(lines) + "\n")
    tokenizer = train.prepare_tokenizer(corpora, tmp_path / "tok", vocab_size=300)
    ids = tokenizer("the quick brown fox")["input_ids"]
    assert ids[0] == train.BOS_ID and train.BOS_ID not in ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the quick brown fox"
    assert len(tokenizer) == 300
    stamp = (tmp_path / "tok" / "tokenizer.json").stat().st_mtime_ns
    train.prepare_tokenizer(corpora, tmp_path / "tok", vocab_size=300)
    assert (tmp_path / "tok" / "tokenizer.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="vocabulary"):
        train.prepare_tokenizer(corpora, tmp_path / "tok", vocab_size=400)
