"""Sampling methods, config refusal, and input validation of the public API."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fmoe_jax.models import UnsupportedConfigError, config_from_hf

import fmoe_jax as fj
from fmoe_jax.generation import bucket_length
from fmoe_jax.testing import PRESETS, write_random_checkpoint


def test_sampling_restrictions():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    key = jax.random.key(0)
    assert fj.Greedy()(logits, key).tolist() == [1, 0]
    for seed in range(20):
        k = jax.random.key(seed)
        assert fj.Sample(top_k=1)(logits, k).tolist() == [1, 0]
        assert fj.Sample(top_p=1e-3)(logits, k).tolist() == [1, 0]
        assert set(fj.Sample(top_k=2)(logits, k).tolist()[:1]) <= {1, 3}


def test_sampling_follows_distribution():
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.1]]))
    draws = np.asarray([fj.Sample()(logits, jax.random.key(s))[0] for s in range(400)])
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], rtol=0, atol=0.07)


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        fj.Sample(**bad)


def test_unknown_family_and_unsupported_attribute_are_refused():
    base = dict(PRESETS["tiny-mixtral"])
    with pytest.raises(UnsupportedConfigError, match="model_type 'llama' is not supported"):
        config_from_hf({**base, "model_type": "llama"})
    with pytest.raises(UnsupportedConfigError, match="hidden_act='gelu'"):
        config_from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedConfigError, match="rope type 'yarn'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_bucket_lengths_are_few_and_tight():
    assert [bucket_length(n) for n in (1, 16, 17, 25, 100, 300)] == [16, 16, 24, 32, 128, 384]
    for n in range(1, 2000, 7):
        assert n <= bucket_length(n) <= max(16, 1.5 * n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("tiny"), PRESETS["tiny-mixtral"])
    return fj.load_model(path)


def test_prompt_validation(tiny):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        fj.generate(tiny, [[1] * 4090], max_new_tokens=10)
    with pytest.raises(ValueError, match="outside"):
        fj.generate(tiny, [[1, 99999]])
    with pytest.raises(ValueError, match="has no tokenizer"):
        fj.generate(tiny, ["hello"])
    with pytest.raises(ValueError, match="empty"):
        fj.generate(tiny, [[]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        fj.generate(tiny, [[1, 2]], max_new_tokens=0)


def test_eos_stops_a_row(tiny):
    free = fj.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=12, stop_at_eos=False).tokens
    eos_token = free[0][3]
    tiny.eos_token_ids = (eos_token,)
    try:
        out = fj.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=12).tokens
    finally:
        tiny.eos_token_ids = ()
    first = free[0].index(eos_token)
    assert out[0] == free[0][: first + 1]
    if eos_token in free[1]:
        assert out[1] == free[1][: free[1].index(eos_token) + 1]
    else:
        assert out[1] == free[1]


def test_missing_path_error():
    with pytest.raises(FileNotFoundError, match="neither an existing path nor a shipped model"):
        fj.load_model("/nonexistent/model")


def test_random_checkpoint_is_loadable_by_transformers(tmp_path):
    import transformers

    path = write_random_checkpoint(tmp_path / "m", PRESETS["tiny-mixtral"], shard_bytes=300_000)
    assert json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = np.arange(1, 20)[None]
    import torch

    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(fj.forward(fj.load_model(path), ids)), ref, rtol=0, atol=1e-4)
