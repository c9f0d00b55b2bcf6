"""`make demo`'s helpers: its per-user checkpoint cache (reused only while it matches the shipped files),
prompt shortening and the closing paragraph."""

from __future__ import annotations

import json

import pytest

from fmoe_jax import demo


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo.default_cache_dir() == tmp_path / "fmoe_jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.default_cache_dir() == tmp_path / "home" / ".cache" / "fmoe_jax"


def test_converted_checkpoint_is_reused_only_while_it_matches(tmp_path, capsys):
    def printed() -> str:
        return " ".join(capsys.readouterr().out.split())  # the demo wraps its lines

    first = demo.prepare_checkpoint("fmoe-tiny-mixtral", tmp_path)
    assert "converting fmoe-tiny-mixtral" in printed()
    assert (first / "chat_template.jinja").exists()
    assert demo.prepare_checkpoint("fmoe-tiny-mixtral", tmp_path) == first
    assert "reusing" in printed()
    # a conversion of other shipped files (here: a record that no longer matches) is converted again
    manifest = json.loads((first / "fmoe_manifest.json").read_text())
    manifest["source_files"]["config.json"]["sha256"] = "0" * 64
    (first / "fmoe_manifest.json").write_text(json.dumps(manifest))
    demo.prepare_checkpoint("fmoe-tiny-mixtral", tmp_path)
    assert "(config.json changed)" in printed()
    assert demo.prepare_checkpoint("fmoe-tiny-mixtral", tmp_path) == first
    assert "reusing" in printed()


@pytest.mark.parametrize(
    "text, width, expected",
    [
        ("short prompt", 40, "short prompt"),
        ("It was late in the evening when the old man finally", 30, "It was late in the evening…"),
        ("  padded  ", 10, "padded"),
        ("averyveryverylongwordwithoutspaces", 10, "averyvery…"),
    ],
)
def test_shorten_cuts_at_a_word_boundary(text, width, expected):
    assert demo.shorten(text, width) == expected
    assert len(demo.shorten(text, width)) <= width


def test_interpretation_reads_the_numbers():
    rows = {
        "fmoe": dict(hit_rate=0.65, tpot_ms=15.7, wasted=54, prefetches=396),
        "on_demand_lru": dict(hit_rate=0.58, tpot_ms=10.8, wasted=0, prefetches=0),
    }
    text = demo.interpretation(rows, expert_kb=197, backend="cpu")
    assert "65%" in text and "58%" in text and "+7%" in text and "54 of 396" in text
    assert "decodes slower than LRU here (15.7 against 10.8 ms)" in text and "197 KB" in text
    rows["fmoe"]["tpot_ms"] = 9.0
    assert "decodes faster than LRU" in demo.interpretation(rows, expert_kb=197, backend="cpu")
