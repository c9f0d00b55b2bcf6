"""Conversion and loading refuse what would silently give a wrong model: a cast that overflows the target
dtype (by tensor name, before anything is written), an `lm_head.weight` that a tied config would ignore
(unless `--untie`), and a converted `config.json` edited since the conversion (same size: only its hash
tells)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_convert_errors import TINY, assert_failed_cleanly, convert, edit_config

import fmoe_jax as fj
from fmoe_jax.checkpoint import orbax_io
from fmoe_jax.checkpoint.hf import CheckpointError, SafetensorsFile, write_safetensors
from fmoe_jax.testing import write_random_checkpoint

HOT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
TOKENS = [[3, 14, 15, 92, 65, 35]]


def edit_tensors(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    header = SafetensorsFile(path)
    tensors = {k: header.read(k) for k in header.entries}
    edit(tensors)
    write_safetensors(path, tensors)


@pytest.fixture
def source(tmp_path) -> Path:
    return write_random_checkpoint(tmp_path / "hf", TINY)


def test_a_cast_that_overflows_is_refused_by_tensor_before_anything_is_written(
    source, tmp_path, capsys, monkeypatch
):
    edit_tensors(source, lambda t: t[HOT].__setitem__((5, 7), 1e5))  # beyond float16's 65504
    writes = []
    monkeypatch.setattr(orbax_io, "write_items", lambda *a, **k: writes.append(a))
    rc = convert(source, tmp_path / "out", "--dtype", "float16")
    assert_failed_cleanly(
        capsys, rc, tmp_path / "out", f"tensor {HOT!r} holds values up to 100000", "float16"
    )
    assert writes == []  # refused before the first item
    with pytest.raises(
        CheckpointError, match=f"tensor '{HOT}' holds values up to 100000 in magnitude, beyond"
    ):
        fj.load_model(source, dtype="float16")
    monkeypatch.undo()
    assert convert(source, tmp_path / "bf16", "--dtype", "bfloat16") == 0  # bfloat16 has float32's range


def test_float16_within_range_converts(source, tmp_path):
    edit_tensors(source, lambda t: t[HOT].__setitem__((5, 7), 6e4))
    assert convert(source, tmp_path / "out", "--dtype", "float16") == 0
    assert np.isfinite(np.asarray(fj.forward(fj.load_model(tmp_path / "out"), TOKENS))).all()


def test_a_tied_config_with_its_own_lm_head_is_refused_or_untied(source, tmp_path, capsys):
    untied_logits = np.asarray(fj.forward(fj.load_model(source), TOKENS))
    edit_config(source, tie_word_embeddings=True)  # the checkpoint keeps its lm_head.weight
    rc = convert(source, tmp_path / "out")
    assert_failed_cleanly(
        capsys,
        rc,
        tmp_path / "out",
        "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight'",
        "--untie",
    )
    with pytest.raises(CheckpointError, match="tie_word_embeddings: true\\), so it would be ignored"):
        fj.load_model(source)
    assert convert(source, tmp_path / "untied", "--untie") == 0
    assert json.loads((tmp_path / "untied" / "config.json").read_text())["tie_word_embeddings"] is False
    np.testing.assert_array_equal(
        np.asarray(fj.forward(fj.load_model(tmp_path / "untied"), TOKENS)), untied_logits
    )
    assert main_verify(tmp_path / "untied", source) == 0
    # A head that is a copy of the embedding changes nothing: accepted, tied.
    edit_tensors(source, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()))
    assert convert(source, tmp_path / "tied") == 0
    assert fj.load_model(tmp_path / "tied").config.tie_word_embeddings


def main_verify(out: Path, against: Path) -> int:
    from fmoe_jax.convert.cli import main

    return main(["verify", str(out), "--against", str(against), "--quiet"])


def test_untie_without_a_tied_config_is_refused(source, tmp_path, capsys):
    rc = convert(source, tmp_path / "out", "--untie")
    assert_failed_cleanly(capsys, rc, tmp_path / "out", "--untie:", "does not tie the embeddings")


def test_an_edited_config_of_the_same_size_is_refused_at_load(source, tmp_path):
    assert convert(source, tmp_path / "out") == 0
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "out", edited)
    path = edited / "config.json"
    text = path.read_text()
    assert '"num_experts_per_tok": 2' in text
    path.write_text(text.replace('"num_experts_per_tok": 2', '"num_experts_per_tok": 3'))  # same size
    with pytest.raises(CheckpointError) as err:
        fj.load_model(edited)
    message = str(err.value)
    assert message.startswith(f"{path}: sha256 ") and "differs from the manifest's" in message
    assert "\n" not in message
    fj.load_model(tmp_path / "out").close()  # the intact copy loads
