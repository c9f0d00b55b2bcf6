"""Random Hugging Face checkpoints of a given shape, written without torch, for demos, tests and benchmarks.

`write_random_checkpoint(out_dir, PRESETS["bench-s"])` writes a valid hub-layout checkpoint (config.json,
sharded safetensors) one layer at a time, so even multi-GB checkpoints need little memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from fmoe_jax.checkpoint.hf import SafetensorsFile, write_safetensors
from fmoe_jax.checkpoint.keys import hf_tensors
from fmoe_jax.models import config_from_hf

_MIXTRAL_BASE = dict(
    model_type="mixtral",
    architectures=["MixtralForCausalLM"],
    hidden_act="silu",
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    sliding_window=None,
)

PRESETS: dict[str, dict[str, Any]] = {
    # The benchmark model of the decode, offload and conversion benchmarks (about 3.2 GB in float32).
    "bench-s": dict(
        _MIXTRAL_BASE,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # Small enough for tests and the fallback demo.
    "tiny-mixtral": dict(
        _MIXTRAL_BASE,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}

_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def write_random_checkpoint(
    out_dir: str | os.PathLike,
    hf_config: dict[str, Any],
    *,
    dtype: str = "float32",
    seed: int = 0,
    shard_bytes: int = 1 << 30,
    std: float = 0.02,
) -> Path:
    """Writes config.json and safetensors shards (with an index when more than one) of random weights.

    Norm weights are ones (zero-centred ones zeros) and biases zeros, as a fresh HF model has them; other
    tensors are N(0, std).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from_hf(hf_config)
    np_dtype = np.dtype(_DTYPES[dtype])
    rng = np.random.default_rng(seed)
    (out / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": dtype}, indent=1))

    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    names: list[str] = []

    def flush() -> None:
        names.append(f"part-{len(names):05d}.safetensors")
        write_safetensors(out / names[-1], shards[-1])
        shards[-1] = {}
        sizes[-1] = 0

    for tensor in hf_tensors(cfg, "hub"):
        key = tensor.key
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            # zero-centred norms (Qwen3-Next's, scaling by 1 + w) start at zero; their gated norm is plain
            centred = cfg.norm == "rms_zero_centered" and ".linear_attn." not in key
            value = np.full(tensor.shape, 0.0 if centred else 1.0, np.float32)
        elif key.endswith(".bias"):
            value = np.zeros(tensor.shape, np.float32)
        else:
            value = rng.standard_normal(tensor.shape, dtype=np.float32) * std
        value = value.astype(np_dtype)
        if sizes[-1] and sizes[-1] + value.nbytes > shard_bytes:
            flush()
        shards[-1][key] = value
        sizes[-1] += value.nbytes
    flush()

    if len(names) == 1:
        os.replace(out / names[0], out / "model.safetensors")
    else:
        weight_map = {}
        total = 0
        for i, name in enumerate(names):
            final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
            os.replace(out / name, out / final)

            entries = SafetensorsFile(out / final).entries
            for key, (_, _, begin, end) in entries.items():
                weight_map[key] = final
                total += end - begin
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    return out


def ensure_checkpoint(preset: str, root: str | os.PathLike = "/tmp/fmoe-bench", **kwargs: Any) -> Path:
    """`root/preset`, written once (into a temporary directory renamed on success) and reused afterwards."""
    final = Path(root) / preset
    if (final / "config.json").exists():
        return final
    tmp = Path(root) / f".{preset}.tmp-{os.getpid()}"
    write_random_checkpoint(tmp, PRESETS[preset], **kwargs)
    try:
        os.replace(tmp, final)
    except OSError:  # someone else finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final
