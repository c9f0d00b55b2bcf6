"""Byte-level BPE tokenizers for the small MoE models trained in this project.

Training scripts call `train_bpe_tokenizer`; everything else loads the result with `load_tokenizer`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sized
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
# Their ids are 0..3 in this order in every tokenizer trained here.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)
_N_BYTES = 256
# Chat turns rendered as the speeches of a play ("USER:\n...\n\n"), the dialogue form closest to what the
# training corpora hold (Tiny Shakespeare); the assistant's turn opens with "ASSISTANT:\n". The shipped
# models carry it as `chat_template.jinja`.
CHAT_TEMPLATE = """{{- bos_token -}}
{%- for message in messages -%}
{{- message['role'] | upper }}:
{{ message['content'] | trim }}

{% endfor -%}
{%- if add_generation_prompt -%}
ASSISTANT:
{% endif -%}
"""


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    *,
    seed: int = 0,
    show_progress: bool | None = None,
) -> None:
    """Trains a byte-level BPE tokenizer and saves it where `transformers.AutoTokenizer` loads it.

    Every string round-trips: `decode(encode(text)) == text`, since there is no normaliser, the
    pre-tokeniser maps bytes to symbols without loss, and `encode` adds no special tokens (callers add
    `bos_token_id`/`eos_token_id` themselves).

    Args:
      texts: training text; any iterable of strings (documents, lines or whole corpora).
      vocab_size: total vocabulary, including the 256 byte symbols and the 4 special tokens.
      out_dir: directory for `tokenizer.json` and `tokenizer_config.json`; created if missing.
      seed: the run's seed, accepted so training scripts can pass it through; BPE training in `tokenizers`
        has no randomness, so the result is the same for every seed.
      show_progress: show the `tokenizers` progress bar; by default only when stderr is a terminal.
    """
    del seed  # Training is deterministic; see the docstring.
    minimum = _N_BYTES + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {minimum} entries "
            f"({_N_BYTES} byte symbols + {len(SPECIAL_TOKENS)} special tokens)."
        )
    if show_progress is None:
        show_progress = sys.stderr.isatty()

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    length = len(texts) if isinstance(texts, Sized) else None
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    if vocab_size > minimum and tokenizer.get_vocab_size() == minimum:
        raise ValueError(
            f"training produced no merges (vocabulary {tokenizer.get_vocab_size()}); `texts` is empty or "
            "has no repeated byte pairs."
        )

    # clean_up_tokenization_spaces would turn " ." into "." on decode and break the round trip.
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def load_tokenizer(path: str | Path) -> transformers.PreTrainedTokenizerBase:
    """Loads a tokenizer directory (as written by `train_bpe_tokenizer` or a HF checkpoint)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "no such directory"
        raise FileNotFoundError(
            f"{path}: no tokenizer here (found: {found}); expected a directory with tokenizer.json, "
            "e.g. one written by fmoe_jax.research.tokenizer.train_bpe_tokenizer."
        )
    return transformers.AutoTokenizer.from_pretrained(str(path))
