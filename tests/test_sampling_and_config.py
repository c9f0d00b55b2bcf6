"""Sampling methods, config refusal, and input validation of the public API."""

from __future__ import annotations

import json

import chex
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


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(temperature=0.0), "temperature must be a finite number > 0.*got 0.0"),
        (dict(temperature=float("nan")), "temperature.*got nan"),
        (dict(temperature=float("inf")), "temperature.*got inf"),
        (dict(temperature="hot"), "temperature.*got 'hot'"),
        (dict(top_k=-1), "top_k must be an int >= 0.*got -1"),
        (dict(top_k=2.5), "top_k.*got 2.5"),
        (dict(top_k=True), "top_k.*got True"),
        (dict(top_p=0.0), "top_p must be in \\(0, 1\\].*got 0.0"),
        (dict(top_p=1.5), "top_p.*got 1.5"),
        (dict(top_p=float("nan")), "top_p.*got nan"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0.*got -1.0"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty.*got nan"),
    ],
)
def test_sampling_rejects_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        fj.Sample(**bad)
    if "repetition_penalty" in bad:
        with pytest.raises(ValueError, match=match):
            fj.Greedy(**bad)


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
    for bad in (0, -3, 2.5, True, "8", None):
        with pytest.raises(ValueError, match=f"max_new_tokens must be a positive int, got {bad!r}"):
            fj.generate(tiny, [[1, 2]], max_new_tokens=bad)
    with pytest.raises(ValueError, match="seed must be an int, got 1.5"):
        fj.generate(tiny, [[1, 2]], seed=1.5)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[1, -1]], "prompt 0 has token ids outside \\[0, 512\\).*\\[-1\\]"),
        ([[3], [1, 512]], "prompt 1 has token ids outside \\[0, 512\\).*\\[512\\]"),
        ([[1, 2.5]], "prompt 0 must hold integer token ids, got float64 values such as 2.5"),
        ([[1.0, 2.0]], "prompt 0 must hold integer token ids, got float64 values such as 1.0"),
        ([np.asarray([1.0, 2.0], np.float32)], "prompt 0 must hold integer token ids, got float32"),
        ([[1, True]], "prompt 0 must hold integer token ids, got True"),
        ([[1, [2, 3]]], "prompt 0 must be a rectangular array"),
        ([[[1, 2], [3, 4]]], "prompt 0 must be a flat list of token ids"),
        ([{"role": "user"}], "message 0 must be a dict with a 'role' string and a 'content'"),
        ([2.0, 3.5], "prompt 0 must hold integer token ids, got float64 values such as 3.5"),
        ([object()], "prompt 0 must be a string, a list of token ids or a chat conversation, got object"),
        (b"bytes", "prompts must be a string"),
        ([], "prompts is empty"),
    ],
)
def test_generate_refuses_bad_token_ids(tiny, prompts, match):
    with pytest.raises(ValueError, match=match):
        fj.generate(tiny, prompts, max_new_tokens=2)


@pytest.mark.parametrize(
    "token_ids, match",
    [
        ([[1, -1]], "token_ids has token ids outside \\[0, 512\\).*\\[-1\\]"),
        ([[1, 2, 512]], "outside \\[0, 512\\).*\\[512\\]"),
        (np.asarray([[1.0, 2.0]]), "token_ids must hold integer token ids, got float64"),
        (jnp.asarray([[1.5, 2.0]]), "token_ids must hold integer token ids, got float32 values such as 1.5"),
        ([[1, 2], [3]], "token_ids must be a rectangular array of token ids"),
        (np.asarray([[True, False]]), "must hold integer token ids, got bool"),
    ],
)
def test_forward_refuses_bad_token_ids(tiny, token_ids, match):
    with pytest.raises(ValueError, match=match):
        fj.forward(tiny, token_ids)


def test_forward_accepts_integer_arrays_of_any_int_dtype(tiny):
    ids = [[1, 2, 3, 511]]
    expected = np.asarray(fj.forward(tiny, ids))
    chex.assert_shape(expected, (1, 4, tiny.config.vocab_size))
    chex.assert_type(expected, np.float32)
    for array in (np.asarray(ids, np.int64), np.asarray(ids, np.uint16), jnp.asarray(ids, jnp.int32)):
        chex.assert_trees_all_close(np.asarray(fj.forward(tiny, array)), expected, atol=0, rtol=0)


def test_generate_refuses_bad_stop_rules(tiny):
    with pytest.raises(ValueError, match="eos_token_id must hold ints in \\[0, 512\\).*got 600"):
        fj.generate(tiny, [[1, 2]], eos_token_id=600)
    with pytest.raises(ValueError, match="eos_token_id must hold ints.*got \\[1, 2.0\\]"):
        fj.generate(tiny, [[1, 2]], eos_token_id=[1, 2.0])
    with pytest.raises(ValueError, match="no effect with stop_at_eos=False"):
        fj.generate(tiny, [[1, 2]], eos_token_id=3, stop_at_eos=False)
    with pytest.raises(ValueError, match="stop=.* needs a tokenizer"):
        fj.generate(tiny, [[1, 2]], stop="\n")
    with pytest.raises(ValueError, match="stop must be a non-empty string or a list of them, got \\[''\\]"):
        fj.generate(tiny, [[1, 2]], stop=[""])
    with pytest.raises(ValueError, match="top_logprobs=3 needs return_logprobs=True"):
        fj.generate(tiny, [[1, 2]], top_logprobs=3)
    with pytest.raises(ValueError, match="top_logprobs must be an int in \\[0, 512\\], got 1000"):
        fj.generate(tiny, [[1, 2]], return_logprobs=True, top_logprobs=1000)


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
