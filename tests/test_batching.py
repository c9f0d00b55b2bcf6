"""Continuous batching (`fmoe_jax.batching.ContinuousBatch`): requests joining and leaving between
iterations get, bit for bit, what they get served alone; nothing compiles after the warm-up; rows end at
EOS, stop strings and their length; a cancelled row frees its slot; bad use is a clear error."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from fmoe_jax.models import Layout

import fmoe_jax as fj
from fmoe_jax.batching import ContinuousBatch
from fmoe_jax.generation import resolve_request

PROMPTS = [
    "Once upon a time",
    "KING HENRY:\nWhat say you, lords, to",
    "def fibonacci(n):\n    ",
    "The best way to keep your garden healthy is to water it early, before the sun is high, and then",
    "Die Stadt",
    "It was late in the evening when",
]


def serve(batch: ContinuousBatch, requests: list, *, join_every: int = 1) -> tuple[dict, dict]:
    """Serves `requests` through `batch` in one busy period, letting one join every `join_every` iterations
    (while slots are free); returns each request's tokens and log-probabilities by index."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    waiting = list(enumerate(requests))
    batch.begin()
    iteration = 0
    while waiting or batch.busy:
        if waiting and batch.free and iteration % join_every == 0:
            i, request = waiting.pop(0)
            batch.join(request, i)
        for owner, piece in batch.prefill() + batch.decode():
            tokens[owner].append(piece.token)
            logprobs[owner].append(piece.logprob)
        iteration += 1
    batch.end()
    return tokens, logprobs


@pytest.mark.parametrize(
    "name, offload",
    [
        ("fmoe-tiny-mixtral", dict(policy="fmoe", cache_experts=16, prefetch_distance=1)),
        ("fmoe-tiny-qwen-moe", None),
    ],
    ids=["mixtral-fmoe", "qwen-moe-resident"],
)
def test_joining_and_leaving_rows_get_what_they_get_alone(name, offload):
    """bfloat16 models as shipped: six requests of different lengths share four slots, joining every other
    iteration (so prefills interleave with decode steps and rows leave at different times). Each gets the
    tokens and float32 log-probabilities it gets served alone, exactly; nothing compiles after `warmup`."""
    model = fj.load_model(name, offload=None if offload is None else fj.OffloadConfig(**offload))
    try:
        batch = ContinuousBatch(model, slots=4, context=96, chunk=16)
        assert batch.warmup() > 0
        compiled = sum(model.engine.programs.compilations.values())
        requests = [
            resolve_request(model, p, max_new_tokens=6 + 3 * i, return_logprobs=True, stop_at_eos=False)
            for i, p in enumerate(PROMPTS)
        ]
        alone = [serve(batch, [r]) for r in requests]
        together = serve(batch, requests, join_every=2)
        for i in range(len(requests)):
            assert together[0][i] == alone[i][0][0], PROMPTS[i]
            assert together[1][i] == alone[i][1][0], PROMPTS[i]  # float equality: bit for bit
            assert len(together[0][i]) == requests[i].max_new_tokens
        assert sum(model.engine.programs.compilations.values()) == compiled
        # The first row's tokens are also generate's (a near-tie could differ in bfloat16; none does here).
        ref = fj.generate(model, PROMPTS[0], max_new_tokens=6, stop_at_eos=False)
        assert together[0][0] == ref.tokens[0]
    finally:
        model.close()


def test_gpt_oss_rows_join_and_leave_as_alone(mxfp4_dir):
    """gpt-oss with MXFP4 experts, offloaded under fmoe: sinks and a sliding window over rows that each write
    at their own cache index. Four requests of token ids share two slots; each gets its tokens and
    log-probabilities alone, exactly."""
    offload = fj.OffloadConfig(policy="fmoe", cache_experts=4, prefetch_distance=1)
    model = fj.load_model(mxfp4_dir, dtype="bfloat16", offload=offload)
    try:
        batch = ContinuousBatch(model, slots=2, context=64, chunk=16)
        rng = np.random.default_rng(7)
        prompts = [rng.integers(3, 256, 5 + 7 * i).tolist() for i in range(4)]
        requests = [
            resolve_request(model, p, max_new_tokens=3 + 2 * i, return_logprobs=True)
            for i, p in enumerate(prompts)
        ]
        alone = [serve(batch, [r]) for r in requests]
        together = serve(batch, requests, join_every=2)
        for i in range(len(requests)):
            assert together[0][i] == alone[i][0][0] and together[1][i] == alone[i][1][0], i
    finally:
        model.close()


@pytest.fixture(scope="module")
def mixtral():
    model = fj.load_model("fmoe-tiny-mixtral")
    yield model
    model.close()


def test_rows_end_at_eos_stop_strings_and_length_and_a_cancelled_row_frees_its_slot(mixtral):
    batch = ContinuousBatch(mixtral, slots=2, context=64, chunk=16)
    free_run = resolve_request(mixtral, PROMPTS[0], max_new_tokens=8, stop_at_eos=False)
    tokens = serve(batch, [free_run])[0][0]
    text = mixtral.tokenizer.decode(tokens, skip_special_tokens=True)
    eos = resolve_request(mixtral, PROMPTS[0], max_new_tokens=8, eos_token_id=tokens[3])
    middle = len(text) // 2
    stop = resolve_request(
        mixtral, PROMPTS[0], max_new_tokens=8, stop=text[middle : middle + 3], stop_at_eos=False
    )
    finishes = {}
    batch.begin()
    batch.join(eos, "eos")
    batch.join(stop, "stop")
    assert batch.free == 0
    with pytest.raises(RuntimeError, match="slots are taken"):
        batch.join(free_run, "third")
    got: dict[str, list[int]] = {"eos": [], "stop": []}
    while batch.busy:
        for owner, piece in batch.prefill() + batch.decode():
            got[owner].append(piece.token)
            finishes[owner] = piece.finish_reason
    stats = batch.end()
    assert (got["eos"], finishes["eos"]) == (tokens[:4], "eos")
    assert finishes["stop"] == "stop" and got["stop"] == tokens[: len(got["stop"])]
    assert stats.new_tokens == len(got["eos"]) + len(got["stop"]) and stats.decode_step_s

    batch.begin()
    batch.join(free_run, "left")
    batch.join(free_run, "stays")
    seen: dict[str, int] = {"left": 0, "stays": 0}
    while batch.busy:
        for owner, _ in batch.prefill() + batch.decode():
            seen[owner] += 1
        if seen["left"] == 2 and batch.free == 0:
            batch.leave("left")
            assert batch.free == 1  # free from the next iteration
    batch.end()
    assert seen == {"left": 2, "stays": 8}


def test_what_a_batch_does_not_take_is_a_clear_error(mixtral):
    with pytest.raises(ValueError, match="slots must be a positive int"):
        ContinuousBatch(mixtral, slots=0)
    with pytest.raises(ValueError, match="context must be more than chunk"):
        ContinuousBatch(mixtral, context=16, chunk=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ContinuousBatch(mixtral, context=mixtral.config.max_position_embeddings + 1)
    batch = ContinuousBatch(mixtral, slots=1, context=32, chunk=16)
    sampled = resolve_request(mixtral, "Hi", temperature=0.7)
    assert "greedily" in batch.accepts(sampled)
    with pytest.raises(ValueError, match="greedily"):
        batch.join(sampled, 0)
    assert "trace" in batch.accepts(resolve_request(mixtral, "Hi", record_trace=True))
    assert "one prompt" in batch.accepts(resolve_request(mixtral, ["Hi", "Ho"]))
    long = resolve_request(mixtral, PROMPTS[3], max_new_tokens=8)  # 21 tokens: padded to 32, + 8 > 32
    assert "exceed the batch's context of 32" in batch.accepts(long)
    assert batch.accepts(resolve_request(mixtral, PROMPTS[0], max_new_tokens=16)) is None
    batch.begin()
    with pytest.raises(RuntimeError, match="warm up before serving"):
        batch.join(resolve_request(mixtral, "Hi", max_new_tokens=2), 0)
        batch.warmup()
    batch.leave(0)
    batch.end()


def test_a_write_index_per_row_is_the_shared_one_when_equal(mixtral):
    """The per-row layout (continuous batching) computes what the shared one does when every row writes at
    the same index: the same KV cache and logits, bit for bit (bfloat16 model as shipped)."""
    engine = mixtral.engine
    ids = [mixtral.tokenizer(p)["input_ids"][:6] for p in PROMPTS[:3]]
    tokens = np.asarray([[mixtral.pad_token_id] * (8 - len(p)) + p for p in ids], np.int32)
    key_start = np.asarray([8 - len(p) for p in ids], np.int32)
    key = np.asarray(jnp.zeros((2,), jnp.uint32))
    results = []
    for write in (np.int32(0), np.zeros((3,), np.int32)):
        cache = engine.init_cache(3, 16)
        out, cache = engine.step(
            tokens, cache, Layout(write, key_start, np.ones(3, bool), 8), key, fj.Greedy()
        )
        step = np.asarray(out.tokens)[:, None]
        later = np.int32(8) if np.ndim(write) == 0 else np.full((3,), 8, np.int32)
        out2, cache = engine.step(
            step, cache, Layout(later, key_start, np.ones(3, bool), 1), key, fj.Greedy()
        )
        results.append((np.asarray(out.logits), np.asarray(out2.logits), [np.asarray(c.k) for c in cache]))
    (a1, a2, ak), (b1, b2, bk) = results
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    for x, y in zip(ak, bk, strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_expert_policy_hears_which_request_each_row_serves():
    model = fj.load_model("fmoe-tiny-mixtral", offload=fj.OffloadConfig(policy="fmoe", cache_experts=16))
    try:
        policy, seen = model.engine.policy, []
        hear = policy.on_iteration_start
        policy.on_iteration_start = lambda event: (
            seen.append((event.valid.shape, event.requests)),
            hear(event),
        )
        batch = ContinuousBatch(model, slots=2, context=64, chunk=16)
        requests = [
            resolve_request(model, p, max_new_tokens=3 + i, stop_at_eos=False)
            for i, p in enumerate(PROMPTS[:3])
        ]
        serve(batch, requests)
    finally:
        model.close()
    prefills = [r for shape, r in seen if shape[1] > 1]
    decodes = [r for shape, r in seen if shape[1] == 1]
    assert prefills == [(1,), (2,), (3,)]  # one chunk each, under the request's own id
    assert all(len(r) == 2 for r in decodes)  # a row per slot; -1: a free slot
    assert decodes[0] == (1, -1) and (1, 2) in decodes
    assert (3, 2) in decodes  # request 3 took the slot request 1 left
