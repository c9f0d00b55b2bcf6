"""Shared fixtures: tiny random Hugging Face models of each family, written with `save_pretrained`.

These are the ground truth for parity: built by transformers + torch in float32, small enough to run fast.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("FMOE_TEST_CPU_DEVICES"):  # tests/test_multidevice.py re-runs itself with emulated devices
    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ["FMOE_TEST_CPU_DEVICES"]))

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

# Every model owns its compiled programs, so a test that loads a model again compiles again. XLA's
# persistent cache (a test setting, in a folder of this session) turns those repeats into cache hits:
# ~8 s -> ~0.8 s per load of a shipped model on this CPU.
_XLA_CACHE = tempfile.mkdtemp(prefix="fmoe-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Small configs that still exercise every feature: GQA, >= 2 layers, >= 4 experts, Mixtral's sliding
# window, Qwen's dense layer and shared expert, Phi's biases and LongRoPE (original max 64 < 300 tokens),
# Qwen3's per-head q/k norms with a head_dim that is not hidden / heads and top-8 of 16 experts renormalised,
# OLMoE's whole-projection q/k norms and clip_qkv, DeepSeek-V2's latent attention with YaRN, its dense
# first layer and shared experts, greedy (Lite) and group-limited routing with a q LoRA (V2); Qwen3-Next's and
# Qwen3.5-MoE's Gated DeltaNet layers (two value heads per key head, a 4-tap convolution) beside gated
# attention with partial RoPE, zero-centred norms and a gated shared expert, Qwen3-Next with a dense layer and
# Qwen3.5 saved as the vision-language model it ships as (a tiny vision tower the loaders leave out).
_HYBRID = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    max_position_embeddings=1024,
)
HF_CONFIGS = {
    "mixtral": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        sliding_window=None,
    ),
    "mixtral_window": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        sliding_window=48,
    ),
    "qwen2_moe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        max_position_embeddings=1024,
    ),
    "phimoe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        attention_bias=True,
        lm_head_bias=True,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0],
            "long_factor": [1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0],
            "short_mscale": 1.05,
            "long_mscale": 1.2,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3_moe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=1024,
    ),
    "olmoe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=16,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        clip_qkv=0.8,  # below the largest normalised query/key entries: clamping changes the result
        max_position_embeddings=1024,
        pad_token_id=None,
        eos_token_id=None,
    ),
    # DeepSeek-V2-Lite's shape in small: no q LoRA, greedy top-k, its YaRN settings (mscale = mscale_all_dim).
    "deepseek_v2_lite": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=2,
        num_experts_per_tok=6,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    # DeepSeek-V2's shape in small: q LoRA, group-limited greedy routing scaled by routed_scaling_factor, a
    # YaRN attention factor other than 1.
    "deepseek_v2": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ),
    "qwen3_next": dict(_HYBRID, intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen3_5_moe": dict(_HYBRID, num_experts_per_tok=6),
}
# Qwen3.5-MoE's vision tower, as small as transformers builds it.
QWEN35_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
FAMILY_OF = {
    "mixtral": "mixtral",
    "mixtral_window": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "phimoe": "phimoe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "deepseek_v2_lite": "deepseek_v2",
    "deepseek_v2": "deepseek_v2",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe",
}


def make_hf_model(name: str, seed: int = 0):
    import torch
    import transformers

    config_cls = {
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "phimoe": transformers.PhimoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "olmoe": transformers.OlmoeConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "qwen3_next": transformers.Qwen3NextConfig,
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig,
    }[FAMILY_OF[name]]
    torch.manual_seed(seed)
    config = config_cls(**HF_CONFIGS[name])
    if FAMILY_OF[name] == "qwen3_5_moe":  # as it ships: the vision-language model around the text model
        config = transformers.Qwen3_5MoeConfig(text_config=config.to_dict(), vision_config=QWEN35_VISION)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if FAMILY_OF[name] == "phimoe":
        # Random LayerNorm biases and LM-head bias, so the test sees whether they are applied.
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.LayerNorm) or module is model.lm_head:
                    module.bias.normal_(0.0, 0.02)
    if FAMILY_OF[name] in ("qwen3_moe", "olmoe", "deepseek_v2", "qwen3_next", "qwen3_5_moe"):
        # Random norm weights (q/k norms, MLA's latent norms included), so a norm applied to the wrong
        # axis, or not at all, shows; zero-centred ones (Qwen3-Next's, scaling by 1 + w) around zero.
        centred = FAMILY_OF[name] in ("qwen3_next", "qwen3_5_moe")
        with torch.no_grad():
            for module_name, param in model.named_parameters():
                if "norm" in module_name:
                    param.normal_(0.0 if centred and "linear_attn" not in module_name else 1.0, 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of a saved tiny HF model (created once per session)."""
    out = {}
    root = tmp_path_factory.mktemp("hf")
    for name in HF_CONFIGS:
        model = make_hf_model(name)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="module")
def _free_executables(request):
    """Frees each module's compiled programs when it ends. XLA:CPU maps memory for every executable, and
    one process compiling the whole suite's models would pass the kernel's `vm.max_map_count` (65530),
    where the next compilation segfaults."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()
    if os.environ.get("FMOE_TEST_MAPS_LOG"):  # how many mappings remain after each module
        with open("/proc/self/maps") as maps, open(os.environ["FMOE_TEST_MAPS_LOG"], "a") as log:
            log.write(f"{request.module.__name__} {sum(1 for _ in maps)}\n")
