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
from collections.abc import Mapping  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

# Every model owns its compiled programs, so a test that loads a model again compiles again. XLA's
# persistent cache (a test setting, in a folder of this run) turns those repeats into cache hits:
# ~8 s -> ~0.8 s per load of a shipped model on this CPU. One folder for the run: the first process (under
# xdist the controller) makes it and removes it at exit; the test workers and the pytest processes tests
# start inherit `FMOE_TEST_XLA_CACHE`, so a program one worker compiled is a hit in the other.
_XLA_CACHE = os.environ.get("FMOE_TEST_XLA_CACHE")
if not _XLA_CACHE:
    _XLA_CACHE = os.environ["FMOE_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="fmoe-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# `--dist loadfile` hands a worker one whole file at a time, by default the files with the most tests first,
# which put slow files of a few tests (test_multidevice.py: one, ~2 min) last while the other worker sat
# idle. The files slowest in a measured run (one worker, 4,350 s in all) go first, slowest first; the others
# follow in xdist's order.
SLOWEST_FILES = (
    "test_offload.py",
    "test_parity.py",
    "test_lossless.py",
    "test_trained_models.py",
    "test_experiments.py",
    "test_convert.py",
    "test_batching.py",
    "test_baselines.py",
    "test_multidevice.py",
    "test_quant_loading.py",
    "test_generate_api.py",
    "test_hybrid.py",
    "test_multihost.py",
    "test_engine_isolation.py",
    "test_moe_kernels.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    def rank(scope: str) -> int:
        name = Path(scope).name
        return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)

    class SlowestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            self.workqueue.move_to_end(min(self.workqueue, key=rank), last=False)
            super()._assign_work_unit(node)

    return SlowestFirst(config, log)


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
    # gpt-oss's shape in small: sliding (128, crossed by 320-token prompts) then full attention, sinks, YaRN
    # as gpt-oss ships it, top-2 of 8 experts with biases; a SwiGLU clamp low enough to bite at this scale.
    "gpt_oss": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,
        max_position_embeddings=131072,
        swiglu_limit=0.1,
    ),
    # DeepSeek-V3's shape in small: sigmoid routing in n_group=4 groups (topk_group=2) with a correction bias
    # (randomised in make_hf_model), renormalised then scaled by 2.5, q LoRA, YaRN, a dense first layer.
    "deepseek_v3": dict(
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
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # GLM-4.5's shape in small: q/k/v biases, per-head q/k norms, RoPE on half of each head, sigmoid routing
    # with a correction bias in one group, a shared expert, a dense first layer.
    "glm4_moe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        use_qk_norm=True,
        attention_bias=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=1024,
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
    "gpt_oss": "gpt_oss",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm4_moe",
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
        "gpt_oss": transformers.GptOssConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
        "glm4_moe": transformers.Glm4MoeConfig,
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
    if FAMILY_OF[name] in (
        *("qwen3_moe", "olmoe", "deepseek_v2", "gpt_oss", "deepseek_v3", "glm4_moe"),
        *("qwen3_next", "qwen3_5_moe"),
    ):
        # Random norm weights (q/k norms, MLA's latent norms included), so a norm applied to the wrong
        # axis, or not at all, shows; zero-centred ones (Qwen3-Next's, scaling by 1 + w) around zero.
        centred = FAMILY_OF[name] in ("qwen3_next", "qwen3_5_moe")
        with torch.no_grad():
            for module_name, param in model.named_parameters():
                if "norm" in module_name:
                    param.normal_(0.0 if centred and "linear_attn" not in module_name else 1.0, 0.2)
    if FAMILY_OF[name] in ("gpt_oss", "deepseek_v3", "glm4_moe"):
        # Random biases (attention, router, experts), sinks and score-correction biases: transformers starts
        # most of them at zero, where a bias left out would not show. Router weights 10x transformers' init,
        # so that the tokens' routing, not the biases, decides which experts they use.
        with torch.no_grad():
            for module_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if module_name.endswith("sinks"):
                    tensor.normal_(0.0, 1.0)
                elif module_name.endswith("e_score_correction_bias"):
                    tensor.normal_(0.0, 0.1)
                elif module_name.endswith("bias"):  # the size of the embeddings, which it must not drown
                    tensor.normal_(0.0, 0.02)
                if module_name.endswith(("mlp.router.weight", "mlp.gate.weight")):
                    tensor.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class HFDirs(Mapping):
    """name -> directory of a saved tiny HF model, written on first use, once for the whole run: the test
    workers and the test processes they start (which inherit `FMOE_TEST_HF_ROOT`) share one folder, a lock
    per model, since building every family's model with torch takes minutes."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, name: str) -> Path:
        if name not in HF_CONFIGS:
            raise KeyError(name)
        from filelock import FileLock

        path = self.root / name
        with FileLock(str(self.root / f"{name}.lock")):
            if not path.is_dir():
                partial = self.root / f"{name}.partial"
                shutil.rmtree(partial, ignore_errors=True)
                make_hf_model(name).save_pretrained(partial)
                partial.rename(path)
        return path

    def __iter__(self):
        return iter(HF_CONFIGS)

    def __len__(self) -> int:
        return len(HF_CONFIGS)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> HFDirs:
    root = os.environ.get("FMOE_TEST_HF_ROOT")
    if not root:
        base = tmp_path_factory.getbasetemp()  # under xdist each worker's; their parent is the run's
        root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hf-models"
        os.environ["FMOE_TEST_HF_ROOT"] = str(root)
    return HFDirs(Path(root))


def write_mxfp4(src: Path, dst: Path, seed: int = 0) -> Path:
    """A gpt-oss checkpoint with MXFP4 experts named as gpt-oss publishes them (`*_blocks` `[J, out, in/32,
    16]`, `*_scales` `[J, out, in/32]`, uint8), from the float one at `src`: random codes (every e2m1 value)
    and scales of 2**-9 .. 2**-6, the size of the float model's weights; every other tensor kept."""
    import json

    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for key, value in load_file(src / "model.safetensors").items():
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[key] = value
            continue
        j, fan_in, out = value.shape  # transformers keeps them [in, out]; MXFP4 rows are outputs
        tensors[f"{key}_blocks"] = rng.integers(0, 256, (j, out, fan_in // 32, 16), dtype=np.uint8)
        tensors[f"{key}_scales"] = rng.integers(118, 122, (j, out, fan_in // 32), dtype=np.uint8)
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


FP8_BLOCK = [16, 16]  # DeepSeek-V3 ships [128, 128]; 16 gives the tiny model several blocks and partial ones


def fp8_quantize(w: np.ndarray, block: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """`[out, in]` float32 -> (e4m3 values as a float32 array of representable values, per-block
    `weight_scale_inv` `[ceil(out/bo), ceil(in/bi)]`): each block scaled to e4m3's largest value, 448."""
    import ml_dtypes

    bo, bi = block
    rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros_like(w, dtype=np.float32)
    for r in range(rows):
        for c in range(cols):
            block_of = (slice(r * bo, (r + 1) * bo), slice(c * bi, (c + 1) * bi))
            scale[r, c] = max(np.abs(w[block_of]).max() / 448.0, 1e-12)
            q[block_of] = (w[block_of] / scale[r, c]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def write_fp8(src: Path, dst: Path) -> Path:
    """A DeepSeek-V3 checkpoint in FP8 as DeepSeek publishes it, from the float one at `src`: every linear
    weight but the router's, the embedding and the LM head as e4m3 with block scales (`weight_scale_inv`),
    `quantization_config` fp8 with `weight_block_size`, and a multi-token-prediction layer after the last."""
    import json

    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    tensors = {}
    config = json.loads((src / "config.json").read_text())
    for key, value in load_file(src / "model.safetensors").items():
        quantized = value.ndim == 2 and key.endswith("proj.weight") and ".mlp.gate." not in key
        if not quantized:
            tensors[key] = torch.from_numpy(value)
            continue
        q, scale = fp8_quantize(value, FP8_BLOCK)
        tensors[key] = torch.from_numpy(q).to(torch.float8_e4m3fn)
        tensors[f"{key}_scale_inv"] = torch.from_numpy(scale)
    mtp = f"model.layers.{config['num_hidden_layers']}"
    tensors[f"{mtp}.eh_proj.weight"] = torch.zeros(config["hidden_size"], 2 * config["hidden_size"])
    tensors[f"{mtp}.enorm.weight"] = torch.ones(config["hidden_size"])
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": FP8_BLOCK,
    }
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="session")
def fp8_dir(hf_dirs, tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 in FP8 with block scales (`write_fp8`)."""
    return write_fp8(hf_dirs["deepseek_v3"], tmp_path_factory.mktemp("fp8") / "deepseek_v3_fp8")


@pytest.fixture(scope="session")
def mxfp4_dir(hf_dirs, tmp_path_factory) -> Path:
    """The tiny gpt-oss with its experts in MXFP4 (`write_mxfp4`)."""
    return write_mxfp4(hf_dirs["gpt_oss"], tmp_path_factory.mktemp("mxfp4") / "gpt_oss_mxfp4")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to watch
        return 0


def _clear_executables() -> None:
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


# XLA:CPU maps memory for every executable, and a process that passes the kernel's `vm.max_map_count`
# (65530 by default) segfaults at its next compilation. A module that compiles many models (the lossless
# property tests) can pass it alone, so a test that leaves more than this many mappings frees them.
_MAPPINGS_TO_FREE = 30_000


@pytest.fixture(autouse=True)
def _free_executables_when_many():
    yield
    if _memory_mappings() > _MAPPINGS_TO_FREE:
        _clear_executables()


@pytest.fixture(autouse=True, scope="module")
def _free_executables(request):
    """Frees each module's compiled programs when it ends (see `_MAPPINGS_TO_FREE`)."""
    yield
    _clear_executables()
    if os.environ.get("FMOE_TEST_MAPS_LOG"):  # how many mappings remain after each module
        with open(os.environ["FMOE_TEST_MAPS_LOG"], "a") as log:
            log.write(f"{request.module.__name__} {_memory_mappings()}\n")
