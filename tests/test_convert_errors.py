"""`fmoe-convert` on bad input: one clear line, a non-zero exit, no traceback and no output left behind.

Sources are random tiny checkpoints written without torch (`write_random_checkpoint`), then damaged.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from fmoe_jax.convert import cli
from fmoe_jax.convert.cli import main
from test_convert_safety import converting

import fmoe_jax as fj
from fmoe_jax.checkpoint import orbax_io
from fmoe_jax.checkpoint.hf import CheckpointError, SafetensorsFile, write_safetensors
from fmoe_jax.testing import PRESETS, write_random_checkpoint

TINY = dict(
    PRESETS["tiny-mixtral"], vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2
)
LAYER0_W1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"


@pytest.fixture
def source(tmp_path) -> Path:
    """A valid sharded checkpoint (several safetensors files and an index) to damage."""
    return write_random_checkpoint(tmp_path / "hf", TINY, shard_bytes=64 << 10)


def shard_of(directory: Path, key: str) -> Path:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][key]


def rewrite_shard(directory: Path, key: str, edit) -> None:
    """Rewrites the shard holding `key` with `edit(tensors)` applied, and updates the index to match."""
    path = shard_of(directory, key)
    header = SafetensorsFile(path)
    tensors = {k: header.read(k) for k in header.entries}
    edit(tensors)
    write_safetensors(path, tensors)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != path.name}
    index["weight_map"].update({k: path.name for k in tensors})
    index_path.write_text(json.dumps(index))


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def assert_failed_cleanly(capsys, rc: int, out_dir: Path, *fragments: str) -> str:
    """One `fmoe-convert: error:` line containing every fragment; neither OUT_DIR nor a work dir remains."""
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err.startswith("fmoe-convert: ") and "\n" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not out_dir.exists()
    assert not [p.name for p in out_dir.parent.glob(f".{out_dir.name}.fmoe-*")]
    return err


def convert(src: Path, out: Path, *extra: str) -> int:
    return main([str(src), str(out), "--quiet", *extra])


def test_missing_shard(source, tmp_path, capsys):
    shard = shard_of(source, LAYER0_W1)
    shard.unlink()
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "missing", shard.name)


def test_truncated_safetensors(source, tmp_path, capsys):
    shard = shard_of(source, LAYER0_W1)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "truncated", shard.name)


def test_corrupt_safetensors_header(source, tmp_path, capsys):
    shard = shard_of(source, LAYER0_W1)
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "corrupt safetensors header", shard.name)


def test_bytes_after_the_last_tensor(source, tmp_path, capsys):
    shard = shard_of(source, LAYER0_W1)
    with open(shard, "ab") as f:
        f.write(b"\0" * 24)
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "24 bytes after the last tensor", shard.name)


def test_integer_weights_are_refused_by_name(source, tmp_path, capsys):
    """A weight stored as int32 would be cast silently; it is refused, naming the tensor and the file."""
    rewrite_shard(
        source, LAYER0_W1, lambda tensors: tensors.update({LAYER0_W1: tensors[LAYER0_W1].astype("int32")})
    )
    rc = convert(source, tmp_path / "out")
    assert rc == 1
    assert_failed_cleanly(capsys, rc, tmp_path / "out", LAYER0_W1, "int32", shard_of(source, LAYER0_W1).name)
    with pytest.raises(CheckpointError, match=f"{LAYER0_W1}' is stored as int32"):
        fj.load_model(source)  # the same check guards loading a Hugging Face directory


def test_missing_tensor(source, tmp_path, capsys):
    rewrite_shard(source, LAYER0_W1, lambda tensors: tensors.pop(LAYER0_W1))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "missing", LAYER0_W1)


def test_unexpected_tensor(source, tmp_path, capsys):
    extra = "model.layers.0.block_sparse_moe.experts.9.w1.weight"
    rewrite_shard(source, LAYER0_W1, lambda tensors: tensors.update({extra: tensors[LAYER0_W1]}))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "unexpected", extra)


def test_shape_mismatch_names_both_shapes(source, tmp_path, capsys):
    rewrite_shard(source, LAYER0_W1, lambda tensors: tensors.update({LAYER0_W1: tensors[LAYER0_W1][:40]}))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", LAYER0_W1, "(40, 32)", "(48, 32)")


def test_unsupported_model_type(source, tmp_path, capsys):
    edit_config(source, model_type="llama")
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "model_type 'llama' is not supported", "mixtral")


def test_unsupported_config_attribute(source, tmp_path, capsys):
    edit_config(source, hidden_act="gelu")
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "hidden_act='gelu'")


def test_missing_config_attribute(source, tmp_path, capsys):
    config = json.loads((source / "config.json").read_text())
    del config["num_local_experts"]
    (source / "config.json").write_text(json.dumps(config))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "config.json", "'num_local_experts'")


def test_output_parent_is_not_a_directory(source, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    rc = convert(source, tmp_path / "file" / "out")
    err = capsys.readouterr().err
    assert rc == 1 and "not an existing directory" in err and "\n" not in err.strip()


def test_unwritable_output_directory(source, tmp_path, capsys):
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    # Root ignores permission bits; an immutable directory refuses root too (needs chattr and ext4/xfs).
    immutable = (
        os.geteuid() == 0 and subprocess.run(["chattr", "+i", parent], capture_output=True).returncode == 0
    )
    if os.geteuid() == 0 and not immutable:
        parent.chmod(0o755)
        pytest.skip("running as root without a working chattr: cannot make a directory unwritable")
    try:
        rc = convert(source, parent / "out")
        assert_failed_cleanly(capsys, rc, parent / "out", "cannot create the output there")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", parent], check=True)
        parent.chmod(0o755)


def test_not_enough_disk_space(source, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1000))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "not enough free disk space")


def failing_save(monkeypatch, exc: Callable[[Path], BaseException], after: int = 1) -> None:
    """Makes the (after+1)-th orbax item write raise `exc(item path)`, after earlier items were written."""
    real, calls = orbax_io._save, []

    def save(ckptr, path, flat):
        calls.append(path)
        if len(calls) > after:
            raise exc(path)
        real(ckptr, path, flat)

    monkeypatch.setattr(orbax_io, "_save", save)


def test_disk_full_while_writing(source, tmp_path, capsys, monkeypatch):
    failing_save(monkeypatch, lambda path: OSError(errno.ENOSPC, "No space left on device", str(path)))
    rc = convert(source, tmp_path / "out")
    assert rc == 1
    err = assert_failed_cleanly(capsys, rc, tmp_path / "out")
    assert err == (
        f"fmoe-convert: error: {tmp_path / 'out'}: cannot write the checkpoint: No space left on device "
        "(writing dense_layer_000)"
    )


def test_interrupted_conversion_leaves_nothing(source, tmp_path, capsys, monkeypatch):
    failing_save(monkeypatch, lambda path: KeyboardInterrupt())
    rc = convert(source, tmp_path / "out")
    assert rc == 130
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "interrupted")


def test_existing_output_is_refused_and_kept(source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert(source, out) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert convert(source, out, "--overwrite") == 1
    assert f"{out}: not replaced: it is not empty and has no fmoe_manifest.json" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine" and [p.name for p in out.iterdir()] == ["keep.txt"]


def test_stale_work_directories_are_removed(source, tmp_path, capsys):
    stale = tmp_path / ".out.fmoe-tmp-999999999"
    stale.mkdir()
    assert convert(source, tmp_path / "out") == 0
    assert not stale.exists()


def test_sigterm_removes_partial_output(tmp_path):
    """A killed job (SIGTERM) unwinds like Ctrl-C: the work directory is deleted, OUT_DIR never appears."""
    many_layers = dict(TINY, num_hidden_layers=24)  # ~25 orbax items: long enough to be caught mid-way
    src = write_random_checkpoint(tmp_path / "hf", many_layers)
    out = tmp_path / "out"
    proc = converting(src, out, "--quiet")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "fmoe-convert: interrupted; nothing was written"
    assert not out.exists() and not list(tmp_path.glob(".out.fmoe-*"))


# -- checkpoints quantized as published (tests/test_published_quantization.py converts the valid ones) -------
def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_single(directory: Path, edit) -> None:
    """Rewrites `model.safetensors` (FP8 included, through torch) with `edit(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_fp8_weights_without_their_scales(fp8_dir, tmp_path, capsys):
    source = copy_of(fp8_dir, tmp_path / "hf")
    weight = "model.layers.1.mlp.experts.3.up_proj.weight"
    rewrite_single(source, lambda tensors: tensors.pop(f"{weight}_scale_inv"))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", weight, f"{weight}_scale_inv", "missing", "FP8")


def test_truncated_mxfp4_block_tensor(mxfp4_dir, tmp_path, capsys):
    """Blocks of 8 bytes where MXFP4 packs 32 values in 16: named, with both shapes."""
    source = copy_of(mxfp4_dir, tmp_path / "hf")
    blocks = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    rewrite_single(source, lambda tensors: tensors.update({blocks: tensors[blocks][..., :8].clone()}))
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", blocks, "(8, 128, 2, 8)", "(8, 128, 2, 16)", "MXFP4")


def test_unknown_quantization_method(hf_dirs, tmp_path, capsys):
    source = copy_of(hf_dirs["deepseek_v3"], tmp_path / "hf")
    edit_config(source, quantization_config={"quant_method": "awq", "bits": 4})
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "quant_method 'awq' is not supported", "config.json")
    with pytest.raises(fj.models.UnsupportedConfigError, match="'awq'"):
        fj.load_model(source)
