"""The simulator's cost model: a roofline time per stage (`CostModel`) of a model preset
(`offload/model_presets.py`) on a hardware preset (`offload/hardware.py`); both modules' names are
re-exported here.

Read by `offload/simulator.py` (which advances its simulated clock by these times) and by benchmarks that
project a routing trace onto real hardware and real model sizes.
"""

from __future__ import annotations

import numpy as np

from .hardware import (  # noqa: F401  (re-exported: the presets' old home)
    A100_SXM,
    DESKTOP_DDR4,
    DESKTOP_DDR5,
    H100_PCIE,
    H100_SXM,
    H200_SXM,
    HARDWARE,
    HOPPER_DECODE,
    HOSTS,
    JAX_COPY_LATENCY_S,
    PCIE4_EFFICIENCY,
    PCIE4_X16,
    PCIE5_EFFICIENCY,
    PCIE5_X16,
    PIECE_MIN_LATENCIES,
    RTX_3090,
    SERVER_8CH,
    SERVER_12CH,
    GiB,
    HardwarePreset,
    HostPreset,
)
from .model_presets import (  # noqa: F401  (re-exported: the presets' old home)
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    GLM_45,
    GLM_45_AIR,
    GPT_OSS_20B,
    GPT_OSS_120B,
    KIMI_K2,
    MIXTRAL_8X7B,
    MODELS,
    OLMOE_1B_7B,
    PHI35_MOE,
    PRESETS,
    QWEN3_30B_A3B,
    QWEN3_NEXT_80B_A3B,
    QWEN15_MOE_A27B,
    QWEN35_35B_A3B,
    QWEN35_122B_A10B,
    ModelPreset,
)

# Tokens per chunk of a linear layer's prefill (`models/gated_deltanet.py`), for its within-chunk FLOPs.
LINEAR_CHUNK = 64


class CostModel:
    """Roofline seconds of each stage of an iteration, for a model preset on a hardware preset.

    Compute counts valid tokens only (no padding). Per MoE layer: the attention block with the router
    (weights + each row's KV cache read from device memory; projections and scores as FLOPs), then the
    routed experts (one grouped kernel per chunk: every cached expert's weights read once, 2 * 3 * D * F
    FLOPs per token routed to it), then the shared expert. Per iteration: the LM head for each active row's
    last token. Decode is thereby memory-bound and prefill compute-bound where the FLOPs dominate.
    """

    def __init__(self, model: ModelPreset, hardware: HardwarePreset, num_experts: int):
        self.model = model
        self.hardware = hardware
        self.num_experts = num_experts
        bp = model.bytes_per_param
        self._attention_params = model.attention_params + model.router_params(num_experts)
        self._attention_bytes = self._attention_params * bp
        self._score_flops = model.score_flops  # QK^T and PV per (query, key) pair

    def attention_s(self, new_tokens: np.ndarray, past_tokens: np.ndarray) -> float:
        """One layer's attention and router: `new_tokens` `[R]` tokens per active row, `past_tokens` `[R]`
        tokens each row already has in its KV cache. A hybrid model's layer kinds are averaged by their shares
        of the MoE layers (the simulator charges every layer of a trace this time): softmax attention reads
        its KV cache, a linear layer its fixed-size state (`linear_attention_s`)."""
        softmax = self.softmax_attention_s(new_tokens, past_tokens)
        share = self.model.linear_layers / self.model.num_layers
        if not share:
            return softmax
        return (1 - share) * softmax + share * self.linear_attention_s(new_tokens)

    def linear_attention_s(self, new_tokens: np.ndarray) -> float:
        """One Gated DeltaNet layer and router: its weights read once and each active row's state read and
        written once; FLOPs of the projections, plus per token the state's decay, read, update and query
        (8 H Dk Dv) and, for a prefill's tokens, the within-chunk scores of its chunked form
        (4 H L (Dk + Dv))."""
        m = self.model
        new = np.asarray(new_tokens, np.float64)
        params = m.linear_attention_params + m.router_params(self.num_experts)
        bytes_read = params * m.bytes_per_param + 2.0 * np.count_nonzero(new) * m.linear_state_bytes
        h, dk, dv = m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
        flops = (2.0 * params + 8.0 * h * dk * dv) * float(new.sum())
        flops += 4.0 * h * LINEAR_CHUNK * (dk + dv) * float(new[new > 1].sum())
        return self.hardware.attention_kernel_s + self.hardware.roofline_s(bytes_read, flops)

    def softmax_attention_s(self, new_tokens: np.ndarray, past_tokens: np.ndarray) -> float:
        """One softmax-attention layer and router (`attention_s`'s arguments)."""
        m = self.model
        new = np.asarray(new_tokens, np.float64)
        past = np.asarray(past_tokens, np.float64)
        keys = float(np.sum(new * past + new * (new + 1) / 2))  # causal: query j sees past + j + 1 keys
        bytes_read = self._attention_bytes + float(np.sum(past + new)) * m.kv_bytes_per_token
        flops = 2 * float(new.sum()) * self._attention_params + self._score_flops * keys
        return self.hardware.attention_kernel_s + self.hardware.roofline_s(bytes_read, flops)

    def experts_s(self, tokens_per_expert: list[int]) -> float:
        """One chunk of routed experts, each with the given number of tokens routed to it."""
        m = self.model
        bytes_read = len(tokens_per_expert) * m.expert_bytes
        flops = 2.0 * m.expert_params * sum(tokens_per_expert)
        fixed = len(tokens_per_expert) * self.hardware.expert_kernel_s
        return fixed + self.hardware.roofline_s(bytes_read, flops)

    def expert_s(self, tokens: int) -> float:
        """One routed expert with `tokens` tokens (`experts_s` of one): the hybrid planner's `DeviceCost`."""
        return self.experts_s([tokens])

    def shared_s(self, tokens: int) -> float:
        """One layer's always-active shared expert (zero for models without one)."""
        m = self.model
        if not m.shared_params:
            return 0.0
        return self.hardware.expert_kernel_s + self.hardware.roofline_s(
            m.shared_params * m.bytes_per_param, 2.0 * m.shared_params * tokens
        )

    def head_s(self, rows: int) -> float:
        """The LM head for `rows` last tokens."""
        m = self.model
        params = m.vocab_size * m.hidden_size
        return self.hardware.roofline_s(params * m.bytes_per_param, 2.0 * params * rows)
