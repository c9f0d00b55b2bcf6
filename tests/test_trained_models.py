"""The trained models that ship with fmoe_jax: they load by name, are real HF checkpoints, and fmoe_jax agrees
with transformers on them (logits and greedy tokens, both loaded in float32 from the bf16 checkpoint)."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest

import fmoe_jax as fj
from fmoe_jax.checkpoint.hf import SafetensorsFile
from fmoe_jax.loading import SHIPPED_DIR

SHIPPED = {
    "fmoe-tiny-mixtral": ("mixtral", 8, 2, 0),
    "fmoe-tiny-qwen-moe": ("qwen2_moe", 32, 4, 1),
    "fmoe-tiny-qwen3-moe": ("qwen3_moe", 64, 8, 0),
}
# Real text, from the start of Tiny Shakespeare (training data: the model should predict it well). Both
# prompts pad to the same 16-token bucket and the generate tests ask for 16 new tokens (one cache length), so
# they share one prefill and one decode compilation.
PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak."
SHORT_PROMPT = "Once upon a time"
MAX_BYTES = 25 * 10**6


@pytest.fixture(scope="module", params=sorted(SHIPPED))
def pair(request):
    """(name, fmoe_jax model, transformers model), both float32."""
    import torch
    import transformers

    name = request.param
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(SHIPPED_DIR / name), dtype=torch.float32
    ).eval()
    return name, fj.load_model(name, dtype="float32"), hf


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoint_is_a_small_bf16_hf_directory(name):
    directory = SHIPPED_DIR / name
    assert name in fj.shipped_models()
    files = {p.name for p in directory.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
    } <= files
    assert sum(p.stat().st_size for p in directory.iterdir()) <= MAX_BYTES
    entries = SafetensorsFile(directory / "model.safetensors").entries
    assert {dtype for dtype, *_ in entries.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == 1


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_load_by_name_gives_the_promised_architecture_and_tokenizer(name):
    from transformers import AutoTokenizer

    family, experts, top_k, has_shared = SHIPPED[name]
    model = fj.load_model(name)
    cfg = model.config
    assert (cfg.family, cfg.num_experts, cfg.top_k) == (family, experts, top_k)
    assert cfg.num_layers >= 8 and all(cfg.moe_layers)
    assert bool(cfg.shared_expert_intermediate_size) == bool(has_shared)
    assert model.eos_token_ids == (1,)
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_DIR / name))
    ids = tokenizer("Once upon a time")["input_ids"]
    assert ids[0] == 0 and 0 not in ids[1:]  # <s> first, as in training
    assert model.tokenizer("Once upon a time")["input_ids"] == ids


def test_logits_match_transformers_and_the_model_is_trained(pair):
    import torch

    name, model, hf = pair
    ids = model.tokenizer(PROMPT)["input_ids"]
    ours = np.asarray(fj.forward(model, [ids]))[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4, err_msg=name)
    # A random model scores ln(8192) = 9.0 nats per token and the train split's unigram frequencies about
    # 6.8 on Tiny Shakespeare (held-out table in the model's README); a trained model must beat both.
    log_probs = np.asarray(jax.nn.log_softmax(ours[:-1], axis=-1))
    nll = -np.mean(np.take_along_axis(log_probs, np.asarray(ids[1:])[:, None], -1))
    assert nll < 6.0, (name, nll)


def test_16_greedy_tokens_match_transformers(pair):
    import torch

    name, model, hf = pair
    ids = model.tokenizer(PROMPT)["input_ids"]
    out = fj.generate(model, [PROMPT], max_new_tokens=16, stop_at_eos=False)
    with torch.no_grad():  # greedy, with transformers' own KV cache; EOS does not stop it
        theirs = hf.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None
        )[0].tolist()
    assert out.tokens[0] == theirs[len(ids) :], name
    assert out.texts[0] == model.tokenizer.decode(out.tokens[0], skip_special_tokens=True)


def test_generate_from_a_string_returns_text(pair):
    name, model, _ = pair
    out = fj.generate(model, [SHORT_PROMPT], max_new_tokens=16)
    assert isinstance(out.texts[0], str) and out.texts[0].strip(), (name, out.texts)
    assert 1 <= len(out.tokens[0]) <= 16


@pytest.mark.parametrize("name", ["fmoe-tiny-qwen3-moe"])  # the others: tests/test_lossless.py
def test_partial_cache_is_bit_identical_to_the_resident_model_in_bfloat16(name):
    """Offloading is lossless on the trained models in their own dtype: every MoE layer's router input and
    every token equal bit for bit between the resident whole-model program and the per-layer programs of
    a 25 % cache. (Without `--xla_allow_excess_precision=false`, which importing fmoe_jax sets, XLA rounded
    the two differently and greedy tokens diverged on these models.)"""
    prompts = [PROMPT, "The theory of a finite group G acting on a smooth manifold"]

    def run(offload):
        model = fj.load_model(name, offload=offload)
        try:
            return [fj.generate(model, [p], 12, record_trace=True, record_hidden=True) for p in prompts]
        finally:
            model.close()

    full = run(fj.OffloadConfig(policy="resident"))
    for policy, options in (("fmoe", {"asynchronous": False}),):  # on_demand_lru: tests/test_lossless.py
        part = run(fj.OffloadConfig(policy=policy, policy_options=options))
        for a, b in zip(full, part, strict=True):
            assert a.tokens == b.tokens, policy
            for x, y in zip(a.trace.requests[0].iterations, b.trace.requests[0].iterations, strict=True):
                assert np.array_equal(x.hidden, y.hidden), policy
                assert np.array_equal(x.ids, y.ids), policy
