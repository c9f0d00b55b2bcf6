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
    assert "decodes 45% slower than LRU here (15.70 against 10.80 ms)" in text and "197 KB" in text
    rows["fmoe"]["tpot_ms"] = 9.0
    assert "decodes 17% faster than LRU" in demo.interpretation(rows, expert_kb=197, backend="cpu")
    # Medians within 2 % are the same pace; with no prefetch the hits came from eviction alone.
    rows["fmoe"].update(tpot_ms=6.39, prefetches=0, wasted=0)
    rows["on_demand_lru"]["tpot_ms"] = 6.36
    text = demo.interpretation(rows, expert_kb=197, backend="cpu")
    assert "decodes about as fast as LRU here (6.39 against 6.36 ms)" in text
    assert "eviction rule" in text and "prefetched nothing" in text and "0 of 0" not in text
