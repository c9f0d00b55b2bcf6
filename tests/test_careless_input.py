"""Careless input to the Python API: every mistake a `ValueError` (or `TypeError` for a wrong kind of
object) whose sentence names the value, raised before any work starts; values that restrict nothing are
accepted."""

from __future__ import annotations

import pytest

import fmoe_jax as fj
from fmoe_jax.errors import ArgumentError
from fmoe_jax.sampling import from_hf_arguments

MODEL = "fmoe-tiny-mixtral"


@pytest.fixture(scope="module")
def model():
    return fj.load_model(MODEL)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("a\ud800b", r"prompt 0 is not valid Unicode text: it holds '\\ud800' at character 1"),
        ([{"role": "user", "content": "x\udfffy"}], r"prompt 0, message 0, 'content' is not valid Unicode"),
        ([{"role": "us\ud800er", "content": "x"}], r"message 0, 'role' is not valid Unicode"),
    ],
)
def test_lone_surrogates_are_a_value_error(model, prompt, match):
    with pytest.raises(ValueError, match=match):
        fj.generate(model, prompt, max_new_tokens=2)


@pytest.mark.parametrize("seed", [2**63, 2**70, -(2**63) - 1])
def test_a_seed_outside_int64_names_the_argument(model, seed):
    with pytest.raises(
        ArgumentError, match=rf"seed must be an int in \[-2\*\*63, 2\*\*63\), got {seed}"
    ) as err:
        fj.generate(model, "Hi", max_new_tokens=2, seed=seed)
    assert err.value.argument == "seed"
    assert fj.generate(model, "Hi", max_new_tokens=2, seed=2**63 - 1, temperature=0.5).tokens[0]


@pytest.mark.parametrize("stop", ["", [""], ["x", ""]])
def test_empty_stop_strings_are_refused(model, stop):
    with pytest.raises(ArgumentError, match="stop must be a non-empty string") as err:
        fj.generate(model, "Hi", max_new_tokens=2, stop=stop)
    assert err.value.argument == "stop"


def test_restrictions_that_restrict_nothing_are_greedy_with_temperature_zero(model):
    assert from_hf_arguments(None, temperature=0, top_k=0) == fj.Greedy()
    assert from_hf_arguments(None, temperature=0, top_p=1.0, top_k=0) == fj.Greedy()
    assert from_hf_arguments(None, do_sample=False, top_k=0) == fj.Greedy()
    with pytest.raises(ArgumentError, match="would ignore top_k=3") as err:
        from_hf_arguments(None, temperature=0, top_k=3)
    assert err.value.argument == "top_k"
    greedy = fj.generate(model, "Hi", max_new_tokens=4)
    assert fj.generate(model, "Hi", max_new_tokens=4, temperature=0, top_k=0).tokens == greedy.tokens


def test_forward_of_an_empty_row_says_so(model):
    with pytest.raises(ValueError, match=r"token_ids must be \[B, T\] with T >= 1, got shape \(1, 0\)"):
        fj.forward(model, [[]])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(offload={"policy": "fmoe"}),
            TypeError,
            r"offload must be None or an fmoe_jax.OffloadConfig, got dict \{'policy': 'fmoe'\}; pass "
            r"offload=fj.OffloadConfig\(\*\*\{'policy': 'fmoe'\}\)",
        ),
        (dict(offload="fmoe"), TypeError, "got str 'fmoe'"),
        (dict(kernel="fast"), ValueError, "kernel must be one of 'auto', .*, got 'fast'"),
        (
            dict(offload=fj.OffloadConfig(cache_experts=2.5)),
            ValueError,
            r"OffloadConfig\(cache_experts=...\) must be an int, got 2.5",
        ),
    ],
)
def test_load_model_refuses_what_it_could_not_serve(kwargs, error, match):
    with pytest.raises(error, match=match):
        fj.load_model(MODEL, **kwargs)
