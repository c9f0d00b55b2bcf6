"""One process of the two-process test in tests/test_multihost.py (not collected by pytest on its own).

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT MODEL_DIR POLICY

Initialises jax.distributed over localhost with 2 CPU devices per process, serves the model with its
experts spread over every process's devices, and prints the generated tokens and local statistics as JSON.
"""

import json
import sys

import jax

process_id, num_processes, port, model_dir, policy = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=120,
)

import fmoe_jax as fj  # noqa: E402

offload = fj.OffloadConfig(
    policy=policy,
    cache_experts=4,
    devices=jax.devices(),
    policy_options={"asynchronous": False} if policy == "fmoe" else {},
)
with fj.load_model(model_dir, offload=offload) as model:
    out = fj.generate(model, [[5, 6, 7, 8, 9], list(range(10, 30))], max_new_tokens=6, stop_at_eos=False)
print(
    "RESULT "
    + json.dumps(
        {
            "process": jax.process_index(),
            "devices": len(jax.devices()),
            "local": len(jax.local_devices()),
            "tokens": out.tokens,
            "per_device": out.stats.extra["per_device"],
        }
    ),
    flush=True,
)
jax.distributed.shutdown()
