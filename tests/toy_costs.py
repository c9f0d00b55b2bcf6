"""The round-number hardware, model and trace on which the simulator tests (test_simulator.py, test_hybrid.py)
compute timelines by hand."""

from __future__ import annotations

import numpy as np
from fmoe_jax.offload.cost_model import HardwarePreset, ModelPreset

from fmoe_jax.trace import RoutingTrace

# Everything memory-bound (FLOPs never bind), link and device memory at 1 GB/s.
TOY_HARDWARE = HardwarePreset(
    "toy",
    hbm_bytes_per_s=1e9,
    flops_per_s=1e18,
    link_bytes_per_s=1e9,
    memory_bytes=10**9,
    link_efficiency=1.0,
    hbm_efficiency=1.0,
    flops_efficiency=1.0,
)
# expert: 3 * 100 * 500 * 2 = 300,000 bytes (300 us on the link, 300 us to read); attention with a router
# over J=2: (2*100*50 + 2*100*50 + 100*2) * 2 = 40,400 bytes; KV: 200 bytes per token; LM head 200,000 bytes.
TOY_MODEL = ModelPreset(
    "toy",
    num_layers=2,
    num_experts=2,
    top_k=1,
    hidden_size=100,
    expert_intermediate_size=500,
    num_heads=1,
    num_kv_heads=1,
    head_dim=50,
    vocab_size=1000,
)


def toy_trace() -> RoutingTrace:
    """One request, a one-token prompt and one decode step; layer 0 routes to expert 0, layer 1 to 1."""
    ids = np.asarray([[[0], [1]]], np.int32)  # [t=1, L=2, k=1]
    return RoutingTrace.from_external([[{"ids": ids}, {"ids": ids}]], num_experts=2)
