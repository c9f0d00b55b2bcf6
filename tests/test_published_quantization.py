"""Checkpoints quantized as their publishers ship them. gpt-oss experts in MXFP4: the expansion against the
slow reference and transformers' own, float32 parity of a tiny MXFP4 gpt-oss with transformers' dequantized
model, experts held and copied at 4.25 bits per weight, and `fmoe-convert` keeping them so. DeepSeek-V3 in
FP8 with block scales: converted dequantized, or into int4 experts. Bad inputs: test_convert_errors.py;
losslessness: test_lossless.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import FP8_BLOCK, make_hf_model
from fmoe_jax.convert.cli import main as convert_main
from fmoe_jax.models import mxfp4
from fmoe_jax.models.mxfp4 import Mxfp4Matrix
from fmoe_jax.offload.config import OffloadConfig
from safetensors.numpy import load_file
from test_parity import hf_logits_and_probs

import fmoe_jax as fj
from fmoe_jax.checkpoint.manifest import Manifest


def transformers_reference(directory):
    """The float transformers gpt-oss the MXFP4 checkpoint was written from (`conftest.write_mxfp4`), with
    each layer's experts replaced by transformers' own dequantization of the checkpoint's blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = make_hf_model("gpt_oss")
    tensors = load_file(directory / "model.safetensors")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                key = f"model.layers.{i}.mlp.experts.{name}"
                blocks, scales = (torch.tensor(tensors[f"{key}_{part}"]) for part in ("blocks", "scales"))
                getattr(layer.mlp.experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    return model


def test_dequantize_matches_the_reference_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    values = rng.integers(0, 256, (6, 48), dtype=np.uint8)  # [out, in/2]: every code in both nibbles
    scales = rng.integers(110, 135, (6, 3), dtype=np.uint8)  # [out, in/32]
    ours = np.asarray(mxfp4.dequantize(Mxfp4Matrix(jnp.asarray(values), jnp.asarray(scales), jnp.float32)))
    np.testing.assert_array_equal(ours, mxfp4.reference_dequantize(Mxfp4Matrix(values, scales, jnp.float32)))
    theirs = convert_moe_packed_tensors(
        torch.tensor(values.reshape(1, 6, 3, 16)), torch.tensor(scales[None]), dtype=torch.float32
    )  # [1, in, out]
    np.testing.assert_array_equal(ours, theirs[0].numpy().T)
    bf16 = mxfp4.dequantize(Mxfp4Matrix(jnp.asarray(values), jnp.asarray(scales), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(bf16.astype(jnp.float32)), ours)  # exact in bfloat16 too


def test_mxfp4_gpt_oss_matches_transformers_dequantized(mxfp4_dir):
    """A 320-token prompt (crossing the 128-token window): logits and router probabilities; then greedy
    generation of a left-padded batch, each row as transformers generates it alone."""
    model = fj.load_model(mxfp4_dir)
    assert model.module.expert_quantization.kind == "mxfp4"
    reference = transformers_reference(mxfp4_dir)
    ids = np.random.default_rng(1).integers(0, 256, (1, 320))
    ref_logits, ref_probs = hf_logits_and_probs(reference, ids)
    logits, probs = fj.forward(model, ids, return_router_probs=True)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(probs), ref_probs, rtol=0, atol=1e-5)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, 37).tolist(), rng.integers(3, 256, 90).tolist()]
    out = fj.generate(model, prompts, max_new_tokens=16, stop_at_eos=False)
    for prompt, ours in zip(prompts, out.tokens, strict=True):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert ours == ref[0, len(prompt) :].tolist()


def test_mxfp4_experts_are_held_and_copied_as_stored(mxfp4_dir):
    """4.25 bits per weight plus the biases, in pinned host memory and on the device alike: what a copy moves
    is the uint8 blocks and scales (nothing expanded on the host), and each miss moves those bytes."""
    model = fj.load_model(mxfp4_dir, offload=OffloadConfig(policy="on_demand_lru", cache_experts=2))
    cfg = model.config
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    want = 3 * d * f * 17 // 32 + (2 * f + d) * 4  # 4.25 bits per weight; float32 biases
    try:
        host = model.module.experts[0][1].weights()
        assert {m.values.dtype for m in (host.gate, host.up, host.down)} == {np.dtype(np.uint8)}
        assert {a.sharding.memory_kind for a in jax.tree.leaves(host)} == {"pinned_host"}
        assert sum(a.nbytes for a in jax.tree.leaves(host)) == want == model.engine.expert_bytes
        out = fj.generate(model, [[5, 17, 99, 3, 250, 42]], max_new_tokens=4, stop_at_eos=False)
        assert out.stats.misses > 0 and out.stats.bytes_to_device == out.stats.misses * want
        cache = model.engine.cache
        arrays = cache.ensure(0, [(0, 1)])[(0, 1)]  # one more copy (or a hit): the arrays a slot holds
        cache.release([(0, 1)])
        leaves = jax.tree.leaves(arrays)
        assert {a.sharding.memory_kind for a in leaves} == {"device"}
        assert [a.dtype for a in jax.tree.leaves((arrays.gate, arrays.up, arrays.down))] == [np.uint8] * 6
        assert sum(a.nbytes for a in leaves) == want
    finally:
        model.close()


def test_fmoe_convert_keeps_mxfp4_experts(mxfp4_dir, tmp_path, capsys):
    """The converted checkpoint stores the same blocks and scales (nothing requantized), records them in
    its manifest, and serves the same logits; asking to quantize them again is refused."""
    out = tmp_path / "converted"
    assert convert_main([str(mxfp4_dir), str(out), "--quiet"]) == 0
    manifest = Manifest.read(out)
    assert manifest.expert_quantization == {"kind": "mxfp4", "group_size": 32}
    cfg = fj.load_model(mxfp4_dir).config
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    assert manifest.bytes_per_expert == 3 * d * f * 17 // 32 + (2 * f + d) * 4
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    ids = np.random.default_rng(5).integers(0, 256, (1, 24))
    np.testing.assert_array_equal(
        np.asarray(fj.forward(fj.load_model(out), ids)), np.asarray(fj.forward(fj.load_model(mxfp4_dir), ids))
    )
    assert convert_main(["verify", str(out), "--against", str(mxfp4_dir), "--quiet"]) == 0
    capsys.readouterr()
    assert convert_main([str(mxfp4_dir), str(tmp_path / "int4"), "--expert-quantization", "int4"]) == 1
    assert "kept as published" in capsys.readouterr().err
    assert not (tmp_path / "int4").exists()


def test_mxfp4_is_kept_never_produced(hf_dirs):
    with pytest.raises(ValueError, match="does not produce MXFP4"):
        fj.load_model(hf_dirs["gpt_oss"], expert_quantization="mxfp4")


def fp8_reference(directory):
    """The float transformers DeepSeek-V3 the FP8 checkpoint was written from (`conftest.write_fp8`), each
    FP8 weight replaced by its e4m3 values times its block's scale (torch's float8, here)."""
    from safetensors.torch import load_file as load_torch

    model = make_hf_model("deepseek_v3")
    tensors = load_torch(directory / "model.safetensors")
    params = dict(model.named_parameters())
    bo, bi = FP8_BLOCK
    with torch.no_grad():
        for key, value in tensors.items():
            if value.dtype != torch.float8_e4m3fn:
                continue
            out, fan_in = value.shape
            scale = tensors[f"{key}_scale_inv"].repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)
            weight = value.float() * scale[:, :fan_in]
            if ".experts." not in key:
                params[key].copy_(weight)
                continue
            # transformers holds a layer's routed experts fused: gate_up_proj [J, 2F, D], down_proj [J, D, F]
            layer, expert, name = key.split(".mlp.experts.")[0], int(key.split(".")[5]), key.split(".")[6]
            fused = params[f"{layer}.mlp.experts.{'down_proj' if name == 'down_proj' else 'gate_up_proj'}"]
            rows = {"gate_proj": slice(0, out), "up_proj": slice(out, 2 * out)}.get(name, slice(None))
            fused[expert, rows].copy_(weight)
    return model


def test_fp8_deepseek_v3_converts_dequantized(fp8_dir, tmp_path):
    """The FP8 weights (blocks of 16 over 24-, 40- and 64-wide matrices: partial blocks too) come out as
    their block-scaled values; the multi-token-prediction layer is left out; loading the FP8 directory
    directly gives the same model."""
    out = tmp_path / "converted"
    assert convert_main([str(fp8_dir), str(out), "--quiet"]) == 0
    assert Manifest.read(out).dtype == "float32"  # the dtype of the checkpoint's unquantized tensors
    ids = np.random.default_rng(6).integers(0, 256, (1, 40))
    reference = fp8_reference(fp8_dir)
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    converted = np.asarray(fj.forward(fj.load_model(out), ids))
    np.testing.assert_allclose(converted, expected, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(fj.forward(fj.load_model(fp8_dir), ids)), converted)
    assert convert_main(["verify", str(out), "--against", str(fp8_dir), "--quiet"]) == 0


def test_fp8_deepseek_v3_converts_into_int4_experts(fp8_dir, tmp_path):
    out = tmp_path / "int4"
    args = [str(fp8_dir), str(out), "--expert-quantization", "int4", "--group-size", "8", "--quiet"]
    assert convert_main(args) == 0
    assert Manifest.read(out).expert_quantization == {"kind": "int4", "group_size": 8}
    model = fj.load_model(out)
    assert model.module.experts[1][0].weights().gate.values.dtype == np.uint8
    ids = np.random.default_rng(6).integers(0, 256, (1, 40))
    with torch.no_grad():
        expected = fp8_reference(fp8_dir)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(fj.forward(model, ids)), expected, rtol=0, atol=0.05)
