"""Tests for fmoe_jax.research.tokenizer: training on a slice of the shared corpora, loading, round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from fmoe_jax.research import tokenizer, workloads

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data directory {DATA} is absent")

VOCAB_SIZE = 500
ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, trailing space ",
    "lines\n\nwith blank lines\r\nand CRLF\n",
    "Grüße aus Köln — naïve café, 日本語, emoji 🙂🚀",
    "def f(x):\n\treturn {'a': x ,  'b': [1, 2]}  # tabs, spaces before punctuation .\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "",
]


def _training_texts() -> list[str]:
    train = workloads.load_corpora(DATA / "corpora", "train")
    return [text[:40_000] for text in train.values()]


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("tok")
    tokenizer.train_bpe_tokenizer(_training_texts(), VOCAB_SIZE, out_dir, show_progress=False)
    return out_dir


def test_auto_tokenizer_loads_a_fast_tokenizer_with_special_tokens(trained_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(trained_dir))
    assert tok.is_fast
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id] == [0, 1, 2, 3]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(trained_dir, text):
    tok = tokenizer.load_tokenizer(trained_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not set(ids) & {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}


def test_merges_compress_training_domain_text(trained_dir):
    tok = tokenizer.load_tokenizer(trained_dir)
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    n_bytes = len(text.encode("utf-8"))
    assert len(tok.encode(text)) < 0.7 * n_bytes  # 240 merges; bytes alone would give n_bytes


def test_special_tokens_encode_as_single_ids(trained_dir):
    tok = tokenizer.load_tokenizer(trained_dir)
    ids = tok.encode("<s>hello</s>")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    batch = tok(["a", "a longer line"], padding=True)
    assert batch["input_ids"][0][-1] == tok.pad_token_id


def test_training_is_deterministic(trained_dir, tmp_path):
    tokenizer.train_bpe_tokenizer(_training_texts(), VOCAB_SIZE, tmp_path, seed=1, show_progress=False)
    assert (tmp_path / "tokenizer.json").read_text() == (trained_dir / "tokenizer.json").read_text()


def test_training_is_quiet_by_default_when_not_on_a_terminal(tmp_path, capfd):
    tokenizer.train_bpe_tokenizer(["hello world, hello there\n"] * 50, 300, tmp_path)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_too_small_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 is too small.*at least 260"):
        tokenizer.train_bpe_tokenizer(["text"], 100, tmp_path)


def test_empty_training_text_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no merges"):
        tokenizer.train_bpe_tokenizer([], 300, tmp_path)


def test_load_tokenizer_without_files_says_what_is_missing(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer here \(found: \['weights.safetensors'\]\)"):
        tokenizer.load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        tokenizer.load_tokenizer(tmp_path / "missing")
