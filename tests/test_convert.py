"""Round trips through `fmoe-convert`: tiny HF models -> orbax checkpoint -> `load_model`, per family.

Also the checkpoint's placement (experts in pinned host memory when offloading), its manifest and files,
and `fmoe-convert verify`. Failure cases of bad input live in `test_convert_errors.py`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import FAMILY_OF
from fmoe_jax.convert.cli import main

import fmoe_jax as fj
from fmoe_jax.checkpoint import orbax_io
from fmoe_jax.checkpoint.hf import write_safetensors
from fmoe_jax.checkpoint.manifest import MANIFEST_NAME, Manifest
from fmoe_jax.loading import param_sharding

# Tiny models of conftest.HF_CONFIGS: one per family, and DeepSeek-V2's two shapes (latent attention with and
# without the q LoRA). DeepSeek-V3 converts from FP8 and gpt-oss from MXFP4 in test_published_quantization.py
# (gpt-oss's float layout goes through the same key table whenever a test loads its HF directory).
FAMILIES = (
    *("mixtral", "qwen2_moe", "phimoe", "qwen3_moe", "olmoe", "deepseek_v2_lite", "deepseek_v2"),
    "glm4_moe",
)
PROMPT = [3, 17, 42, 99, 5, 250, 7, 64, 128, 11, 1, 200]  # vocab of the tiny models is 256
# The shape test_parity.py uses too, so a full run compiles this forward once.
F32_IDS = np.random.default_rng(3).integers(0, 256, (2, 40)).astype(np.int32)
# Float32 parity with torch: both sides compute the same ops in float32 (observed max diff ~1e-6).
F32_ATOL = 1e-5
# Bfloat16 parity: the same bf16 weights, but each side rounds intermediates to bf16 in its own order.
# Logits are below 1, where bf16 values are 2**-8 apart; observed differences reach 1.5 of those steps.
BF16_ATOL = 5 * 2**-8
# Every kernel computes the same mixture (test_moe_kernels.py); "ragged" compiles fastest on CPU.
BF16_KERNEL = "ragged"


def run_cli(*args: str | Path) -> int:
    return main([str(a) for a in args])


def torch_model(directory: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()


def torch_logits(model, ids) -> np.ndarray:
    """Logits `[B, T, V]` as float32 for token ids `[B, T]` (or one list of ids)."""
    import torch

    ids = np.asarray(ids)
    with torch.no_grad():
        return model(torch.tensor(ids if ids.ndim == 2 else ids[None])).logits.float().numpy()


def torch_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding by full forwards (no cache), the plainest reference."""
    out = list(ids)
    for _ in range(steps):
        out.append(int(torch_logits(model, out)[0, -1].argmax()))
    return out[len(ids) :]


def write_fused(src: Path, dst: Path) -> Path:
    """The same weights in the transformers-5 fused layout (`mlp.experts.gate_up_proj` ...)."""
    dst.mkdir()
    tensors = {k: v.detach().numpy() for k, v in torch_model(src).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    write_safetensors(dst / "model.safetensors", tensors)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    """family -> float32 conversion of the session's tiny HF model (hub layout)."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for family in FAMILIES:
        assert run_cli(hf_dirs[family], root / family, "--quiet") == 0
        out[family] = root / family
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_round_trip_matches_hf_logits(family, hf_dirs, converted):
    model = fj.load_model(converted[family])
    assert model.config.family == FAMILY_OF[family]
    logits = np.asarray(fj.forward(model, F32_IDS))
    expected = torch_logits(torch_model(hf_dirs[family]), F32_IDS)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=F32_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layout_converts_to_the_same_parameters(family, hf_dirs, converted, tmp_path):
    fused = write_fused(hf_dirs[family], tmp_path / "fused")
    assert run_cli(fused, tmp_path / "out", "--quiet") == 0
    assert Manifest.read(tmp_path / "out").source_layout == "fused"
    _, _, expected = orbax_io.open_converted(tmp_path / "out")
    from_hub = orbax_io.read_items(converted[family], expected)
    for (name, fused_arrays), (_, hub_arrays) in zip(
        orbax_io.read_items(tmp_path / "out", expected), from_hub, strict=True
    ):
        assert fused_arrays.keys() == hub_arrays.keys()
        for path, value in hub_arrays.items():
            np.testing.assert_array_equal(fused_arrays[path], value, err_msg=f"{name}: {path}")


@pytest.fixture(scope="module")
def converted_bf16(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    """family -> `--dtype bfloat16` conversion of the session's tiny HF model."""
    root = tmp_path_factory.mktemp("converted_bf16")
    for family in FAMILIES:
        assert run_cli(hf_dirs[family], root / family, "--dtype", "bfloat16", "--quiet") == 0
    return {family: root / family for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_round_trip_matches_hf_bfloat16(family, hf_dirs, converted_bf16):
    """Teacher-forced on torch's 16 greedy tokens: our logits agree to bf16 precision and our argmax picks
    the same token at every step, so greedy decoding by full forwards yields the same 16 tokens."""
    assert Manifest.read(converted_bf16[family]).dtype == "bfloat16"
    model = fj.load_model(converted_bf16[family], kernel=BF16_KERNEL)
    assert model.module.embed.embedding.get_value().dtype == np.dtype("bfloat16")
    reference = torch_model(hf_dirs[family], "bfloat16")
    greedy = torch_greedy(reference, PROMPT, 16)
    sequence = PROMPT + greedy
    logits = np.asarray(fj.forward(model, [sequence]))
    theirs = torch_logits(reference, sequence)
    # Agreement to bf16 precision at every position but a routing near-tie: where a layer's top-k boundary
    # is within rounding (Mixtral's tiny model has one at a relative margin of 3e-4), either side may pick
    # the other expert. On a CPU without AVX-512 ours did at one position of Mixtral's and torch's at one of
    # Phi-3.5-MoE's. Such a position is told apart by one side leaving the float32 reference there; a
    # systematic error (a wrong accumulation dtype, a missing scale) would move every position instead.
    apart = np.abs(logits - theirs).max(-1)[0] > BF16_ATOL  # [T]
    if apart.any():
        exact = torch_logits(torch_model(hf_dirs[family]), sequence)
        departed = np.maximum(np.abs(logits - exact), np.abs(theirs - exact)).max(-1)[0] > BF16_ATOL
        assert apart.sum() <= 2 and departed[apart].all(), (np.flatnonzero(apart), np.flatnonzero(departed))
    np.testing.assert_allclose(logits[:, ~apart], theirs[:, ~apart], rtol=0, atol=BF16_ATOL)
    # The same argmax wherever torch's own top-2 margin is above one bf16 step (2**-8): a closer call may go
    # either way, since each side rounds in its own order (Qwen3-MoE's tiny model has one, at a margin of
    # exactly one step, among many more rounded top-8 expert sums). Most steps are far from that.
    ours = logits[0, len(PROMPT) - 1 : -1].argmax(-1)
    top2 = np.sort(torch_logits(reference, sequence)[0, len(PROMPT) - 1 : -1], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2**-8
    assert clear.sum() >= len(greedy) // 2
    np.testing.assert_array_equal(ours[clear], np.asarray(greedy)[clear])


def test_bfloat16_generate_matches_hf_bfloat16_greedy(hf_dirs, converted_bf16):
    """The cached decode path too (prefill, then 15 one-token steps), on one family to bound compile time."""
    model = fj.load_model(converted_bf16["mixtral"], kernel=BF16_KERNEL)
    out = fj.generate(model, [PROMPT], max_new_tokens=16, sampling=fj.Greedy(), stop_at_eos=False)
    assert out.tokens[0] == torch_greedy(torch_model(hf_dirs["mixtral"], "bfloat16"), PROMPT, 16)


def test_offload_restores_experts_into_pinned_host(converted):
    def placed(offload):
        return lambda path: param_sharding(path, offload)

    cfg, dtype, flat = orbax_io.restore_params(converted["qwen2_moe"], sharding=placed(object()))
    experts = {p: a for p, a in flat.items() if p[0] == "experts"}
    assert len(experts) == 3 * cfg.num_experts * cfg.num_moe_layers
    assert {a.sharding.memory_kind for a in experts.values()} == {"pinned_host"}
    assert {a.sharding.memory_kind for p, a in flat.items() if p[0] != "experts"} == {"device"}
    _, _, resident = orbax_io.restore_params(converted["qwen2_moe"], sharding=placed(None))
    assert {a.sharding.memory_kind for a in resident.values()} == {"device"}
    path = ("experts", 2, 5, "down")
    np.testing.assert_array_equal(np.asarray(flat[path]), np.asarray(resident[path]))
    # A float32 checkpoint restored as bfloat16 is cast on the way in.
    _, dtype, cast = orbax_io.restore_params(
        converted["qwen2_moe"], sharding=placed(object()), dtype="bfloat16"
    )
    assert cast[path].dtype == dtype == np.dtype("bfloat16")
    assert cast[path].sharding.memory_kind == "pinned_host"


def test_manifest_and_side_files(hf_dirs, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    src = tmp_path / "src"
    shutil.copytree(hf_dirs["mixtral"], src)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["a tiny corpus for a tiny tokenizer"] * 4, trainers.BpeTrainer(vocab_size=64))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(src)
    out = tmp_path / "out"
    assert run_cli(src, out, "--quiet") == 0

    manifest = Manifest.read(out)
    cfg = json.loads((src / "config.json").read_text())
    assert (manifest.family, manifest.dtype, manifest.source_layout) == ("mixtral", "float32", "hub")
    assert manifest.num_experts == cfg["num_local_experts"] and manifest.moe_layers == [0, 1]
    assert manifest.bytes_per_expert == 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 4
    assert list(manifest.items) == [
        "dense",
        "dense_layer_000",
        "experts_layer_000",
        "dense_layer_001",
        "experts_layer_001",
    ]
    assert manifest.items["experts_layer_001"] == {
        "kind": "experts",
        "arrays": 3 * manifest.num_experts,
        "layer": 1,
        "bytes": manifest.num_experts * manifest.bytes_per_expert,
    }
    weights = (src / "model.safetensors").read_bytes()
    record = manifest.source_files["model.safetensors"]
    assert (record.size, record.sha256) == (len(weights), hashlib.sha256(weights).hexdigest())
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert set(manifest.files) == on_disk
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    model = fj.load_model(out)
    assert model.tokenizer is not None
    assert model.tokenizer.encode("a tiny corpus") == PreTrainedTokenizerFast.from_pretrained(src).encode(
        "a tiny corpus"
    )


def test_overwrite_replaces_an_earlier_checkpoint(hf_dirs, converted, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(converted["mixtral"], out)
    assert run_cli(hf_dirs["phimoe"], out, "--quiet", "--overwrite") == 0
    assert Manifest.read(out).family == "phimoe"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert run_cli("verify", out, "--quiet") == 0


def test_verify_accepts_intact_checkpoint_and_compares_with_source(hf_dirs, converted, capsys):
    assert run_cli("verify", converted["phimoe"], "--against", hf_dirs["phimoe"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "tensors equal" in out


def test_verify_against_other_weights_names_the_tensor(converted, tmp_path, capsys):
    from conftest import make_hf_model

    make_hf_model("phimoe", seed=1).save_pretrained(tmp_path / "other")
    capsys.readouterr()
    assert run_cli("verify", converted["phimoe"], "--against", tmp_path / "other", "--quiet") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fmoe-convert: error:") and "differs from" in err and "\n" not in err


@pytest.mark.parametrize("damage", ["altered", "truncated", "missing"])
def test_verify_detects_damaged_files(converted, tmp_path, capsys, damage):
    out = tmp_path / "ckpt"
    shutil.copytree(converted["mixtral"], out)
    manifest = Manifest.read(out)
    name = max(manifest.files, key=lambda n: manifest.files[n].size)  # an array data file
    target = out / name
    if damage == "altered":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncated":
        with open(target, "r+b") as f:
            f.truncate(manifest.files[name].size - 100)
    else:
        target.unlink()
    assert run_cli("verify", out, "--quiet") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fmoe-convert: error:") and "\n" not in err
    assert name in err and damage in err


def test_help_explains_every_option(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for option in ("HF_DIR", "OUT_DIR", "--dtype", "bfloat16", "--overwrite", "--quiet", "verify"):
        assert option in text
    for model_type in ("mixtral", "qwen2_moe", "phimoe", "qwen3_moe", "olmoe", "deepseek_v2"):
        assert model_type in text
    assert main(["verify", "--help"]) == 0
    assert "--against" in capsys.readouterr().out
