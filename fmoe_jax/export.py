"""Export of an in-memory model (e.g. fresh from `fmoe_jax.research.train`) to a Hugging Face checkpoint
directory.

The training CLI writes the shipped models with it; the result loads in `transformers.AutoModelForCausalLM`
and `AutoTokenizer`, and in `fmoe_jax.load_model`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from fmoe_jax.checkpoint.hf import write_safetensors
from fmoe_jax.checkpoint.keys import to_hf
from fmoe_jax.models import MoECausalLM, config_from_hf

DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def flat_params(module: MoECausalLM) -> dict[tuple, np.ndarray]:
    """{parameter path: NumPy array} of a module, the form `checkpoint.keys.to_hf` takes."""
    return {tuple(path): np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.split(module)[1])}


def complete_hf_config(hf_config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """`hf_config` with every attribute transformers would default spelled out, as `config.json` holds it.

    Writing the defaults makes the file say what transformers will build, whichever defaults a reader
    assumes (transformers' Mixtral defaults `rope_theta` to 1e6, for example).
    """
    import transformers

    fields = {key: value for key, value in hf_config.items() if key != "model_type"}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
    config.dtype = dtype
    return config.to_dict()


def export_hf(
    module: MoECausalLM,
    hf_config: Mapping[str, Any],
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    tokenizer: Any = None,
    readme: str | None = None,
    extra_json: Mapping[str, Any] | None = None,
) -> Path:
    """Writes `config.json`, `generation_config.json`, `model.safetensors` (hub layout) and the tokenizer.

    Args:
      module: the model; its config must be the one `hf_config` describes (checked).
      hf_config: the HF config.json dict the module was built from.
      out_dir: the checkpoint directory; created if missing, files in it are overwritten.
      dtype: "bfloat16", "float16" or "float32" for the stored weights.
      tokenizer: a transformers tokenizer saved beside the weights (`save_pretrained`), or None.
      readme: text of a model card (`README.md`), or None.
      extra_json: {file name: JSON-serialisable object} written beside the weights (training records).
    Returns:
      `out_dir` as a Path.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    full = complete_hf_config(hf_config, dtype)
    cfg = config_from_hf(full)
    if cfg != module.config:
        differ = {
            name: (getattr(cfg, name), getattr(module.config, name))
            for name in cfg.__dataclass_fields__
            if getattr(cfg, name) != getattr(module.config, name)
        }
        raise ValueError(
            "the module was built from another config than the one config.json would hold (attribute: "
            f"(config.json, module)): {differ}; build the module from the complete config or set those "
            "attributes in hf_config."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {key: value.astype(DTYPES[dtype]) for key, value in to_hf(cfg, flat_params(module)).items()}
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    generation = {
        key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if readme is not None:
        (out / "README.md").write_text(readme)
    for name, value in (extra_json or {}).items():
        (out / name).write_text(json.dumps(value, indent=1) + "\n")
    return out
