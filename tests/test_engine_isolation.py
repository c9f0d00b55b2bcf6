"""fmoe_jax changes nothing outside the models it loads: importing it leaves the environment alone, its exact
bfloat16 rounding is a property of its own programs (so it holds when JAX started first), and compiled
programs and their counts belong to the model that made them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import fmoe_jax as fj


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=900,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_import_leaves_the_environment_unchanged():
    out = run_python(
        """
        import os
        before = dict(os.environ)
        import fmoe_jax
        assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
        print("unchanged")
        """
    )
    assert out.strip() == "unchanged"


def test_lossless_in_bfloat16_when_jax_started_before_fmoe_jax():
    """The environment flag this replaced was silently ineffective once JAX had run a computation."""
    out = run_python(
        """
        import jax, jax.numpy as jnp, numpy as np
        jnp.ones(3).block_until_ready()  # the backend starts here, before fmoe_jax is imported
        import fmoe_jax as fj
        prompts = ["def fibonacci(n):", "The theory of a finite group G acting on a smooth manifold"]
        resident = fj.load_model("fmoe-tiny-mixtral")
        record = dict(stop_at_eos=False, record_trace=True, record_hidden=True)
        ref = fj.generate(resident, prompts, 8, **record)
        ids = [[5, 100, 200, 300, 400, 17, 9]]
        for slots in (1, 4):
            offload = fj.OffloadConfig(policy="on_demand_lru", cache_experts=slots)
            with fj.load_model("fmoe-tiny-mixtral", offload=offload) as model:
                out = fj.generate(model, prompts, 8, **record)
                logits = fj.forward(model, ids)
            assert out.tokens == ref.tokens, slots
            for a, b in zip(ref.trace.requests, out.trace.requests):
                for x, y in zip(a.iterations, b.iterations):
                    assert np.array_equal(x.hidden, y.hidden), slots
            assert np.array_equal(np.asarray(logits), np.asarray(fj.forward(resident, ids))), slots
        print("identical")
        """
    )
    assert out.strip() == "identical"


def test_compiled_programs_and_counts_belong_to_the_model(hf_dirs):
    first = fj.load_model(hf_dirs["mixtral"])
    fj.generate(first, [[5, 6, 7]], max_new_tokens=3, stop_at_eos=False)
    counts = dict(first.engine.programs.compilations)
    assert counts and first.engine.programs.compile_s > 0
    second = fj.load_model(hf_dirs["mixtral"])
    assert not second.engine.programs.compilations  # nothing of the first model's is counted here
    fj.generate(second, [[5, 6, 7]], max_new_tokens=3, stop_at_eos=False)
    assert dict(second.engine.programs.compilations) == counts  # its own programs, compiled for itself
    assert dict(first.engine.programs.compilations) == counts  # and the first model's are untouched


def test_a_new_program_runs_once_on_copies_before_the_real_call():
    """XLA's first run of an executable is slow (part of its work happens then); `Programs.jit` runs each new
    program once on copies of the donated arguments and charges that to `compile_s`, so timed calls see only
    warm runs. The copies leave the caller's arrays to the real call, which donates them as asked."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fmoe_jax.engines.programs import Programs

    programs, runs = Programs(), []

    def step(x, cache):
        jax.debug.callback(lambda: runs.append(1))
        return x * 2, cache + x

    jitted = programs.jit(step, lambda x, cache: f"step_T{x.shape[0]}", donate_argnums=1)
    x, cache = jnp.arange(4.0), jnp.ones(4)
    y, cache = jitted(x, cache)
    jax.block_until_ready(cache)
    assert len(runs) == 2 and programs.compile_s > 0  # the throwaway run, then the real one
    assert np.array_equal(y, [0, 2, 4, 6]) and np.array_equal(cache, [1, 2, 3, 4])  # added once
    compiled = programs.compile_s
    y, cache = jitted(x, cache)
    jax.block_until_ready(cache)
    assert len(runs) == 3 and programs.compile_s == compiled  # a known program runs once, untimed
    assert np.array_equal(cache, [1, 3, 5, 7])
    jitted(jnp.arange(8.0), jnp.ones(8))  # a new shape: a new label, compiled and run twice
    jax.effects_barrier()
    assert len(runs) == 5 and dict(programs.compilations) == {"step_T4": 1, "step_T8": 1}
