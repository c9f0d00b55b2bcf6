"""A model shared between threads: calls run one at a time, every valid call gets the tokens it gets alone,
every invalid one its own clear error, and the model is healthy afterwards."""

from __future__ import annotations

import concurrent.futures as cf
import random

import numpy as np
import pytest

import fmoe_jax as fj

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46], [26, 43, 38], [7, 7, 7, 7, 7, 7, 7, 7, 7]]


def _calls(vocab: int) -> list[tuple[str, tuple, dict, type[BaseException] | None, str | None]]:
    """(kind, args, kwargs, expected error, message pattern): valid generate and forward calls mixed with
    invalid ones."""
    valid = [("generate", ([p],), {"max_new_tokens": 4}, None, None) for p in PROMPTS]
    valid += [("forward", ([p],), {}, None, None) for p in PROMPTS]
    invalid = [
        ("generate", ([[5, vocab + 3]],), {"max_new_tokens": 4}, ValueError, str(vocab + 3)),
        ("forward", ([[5, -1, 6]],), {}, ValueError, "-1"),
        ("generate", ([[5, 6]],), {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ("forward", ([[5.5, 6]],), {}, ValueError, "5.5"),
    ]
    return valid + invalid


def _run(model, kind, args, kwargs):
    if kind == "generate":
        return fj.generate(model, *args, stop_at_eos=False, **kwargs).tokens
    return np.asarray(fj.forward(model, *args))


def test_eight_threads_share_one_offloaded_fmoe_model(hf_dirs):
    offload = fj.OffloadConfig(policy="fmoe", cache_experts=3, prefetch_distance=1)
    model = fj.load_model(hf_dirs["mixtral"], offload=offload)
    calls = _calls(model.config.vocab_size)
    alone = {
        i: _run(model, kind, args, kw) for i, (kind, args, kw, err, _) in enumerate(calls) if err is None
    }
    rng = random.Random(0)
    plan = [[rng.randrange(len(calls)) for _ in range(20)] for _ in range(8)]  # 8 threads x 20 calls

    def worker(indices: list[int]) -> list[str]:
        problems = []
        for i in indices:
            kind, args, kwargs, error, pattern = calls[i]
            try:
                got = _run(model, kind, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - compared with what the call should raise
                if error is None or not isinstance(exc, error) or pattern not in str(exc):
                    problems.append(f"call {i} raised {exc!r}")
                continue
            if error is not None:
                problems.append(f"call {i} should have raised {error.__name__}")
            elif kind == "generate" and got != alone[i]:
                problems.append(f"call {i} gave {got}, alone {alone[i]}")
            elif kind == "forward" and not np.array_equal(got, alone[i]):
                problems.append(f"call {i}: logits differ from the call alone")
        return problems

    with cf.ThreadPoolExecutor(8) as pool:
        problems = [p for result in pool.map(worker, plan) for p in result]
    assert not problems, problems[:10]
    # Healthy afterwards: nothing pinned, the matcher alive, calls work and agree with the resident model.
    cache = model.engine.cache
    assert not any(entry.pins for _, entry in cache.entries())
    assert model.engine.policy.matcher.alive
    resident = fj.load_model(hf_dirs["mixtral"])
    assert _run(model, "generate", ([PROMPTS[0]],), {"max_new_tokens": 6}) == _run(
        resident, "generate", ([PROMPTS[0]],), {"max_new_tokens": 6}
    )
    model.close()
    with pytest.raises(RuntimeError, match="is closed"):
        fj.generate(model, [PROMPTS[0]], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="is closed"):
        fj.forward(model, [PROMPTS[0]])


def test_a_failed_call_leaves_no_slot_pinned(hf_dirs, monkeypatch):
    """A call that fails inside a layer (here: a copy that cannot be made) gives back its pins."""
    model = fj.load_model(
        hf_dirs["mixtral"], offload=fj.OffloadConfig(policy="on_demand_lru", cache_experts=2)
    )
    cache = model.engine.cache
    start = cache.mover.start
    calls = {"n": 0}

    def flaky(key, *, urgent=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("device out of memory (simulated)")
        return start(key, urgent=urgent)

    monkeypatch.setattr(cache.mover, "start", flaky)
    with pytest.raises(OSError, match="simulated"):
        fj.generate(model, [PROMPTS[1]], max_new_tokens=3, stop_at_eos=False)
    assert not any(entry.pins for _, entry in cache.entries())
    assert cache.paused == 0
    reference = fj.generate(fj.load_model(hf_dirs["mixtral"]), [PROMPTS[1]], 3, stop_at_eos=False)
    assert fj.generate(model, [PROMPTS[1]], max_new_tokens=3, stop_at_eos=False).tokens == reference.tokens
