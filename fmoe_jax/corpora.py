"""The domain corpora (held-out text) and the prompts cut from them: the one definition of each corpus's
train / held-out split. `fmoe-demo` answers such prompts; the experiments (`fmoe_jax.research.workloads`)
train on the train part and prompt from the held-out part.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from pathlib import Path
from typing import Literal

# Domain name -> file under the corpora directory. The single list of training/evaluation domains.
CORPUS_DOMAINS: dict[str, str] = {
    "arxiv": "olmoe_arxiv.txt",
    "books": "olmoe_books.txt",
    "web": "olmoe_c4.txt",
    "code": "olmoe_github.txt",
    "wikipedia_de": "olmoe_wikipedia.txt",
    "shakespeare": "tinyshakespeare.txt",
}
# Share of each corpus kept out of training; prompts for routing experiments come from it.
HELD_OUT_FRACTION = 0.05

# A prompt may start after a line break or after a sentence end, at a non-space character.
_PROMPT_START = re.compile(r"(?:\n|[.!?][ \t]+)(?=\S)")
# A prompt may end at a line break or right after a sentence end.
_PROMPT_END = re.compile(r"\n|[.!?](?=\s)")


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """One request prompt. `uid` is unique within its source and stable across runs."""

    text: str
    source: str
    category: str
    uid: str


def require_file(path: str | Path, expected: str) -> Path:
    """`path`, if it is a file; else an error saying what was expected there."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; expected {expected}.")
    return path


def stable_key(seed: int, *parts: object) -> int:
    """A 64-bit key from sha256, identical across runs, platforms and Python versions (unlike `hash()`)."""
    digest = hashlib.sha256("\x1f".join(map(str, (seed, *parts))).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def _without_repeat(text: str, probe_chars: int = 1000) -> str:
    """`text` cut where it starts over from its beginning, if its whole tail repeats its head.

    The OLMoE corpus files are their documents followed by a copy of the first ~half of them; without this
    cut, held-out text would also appear in the training part.
    """
    if len(text) < 2 * probe_chars:
        return text
    head = text[:probe_chars]
    start = text.find(head, 1)
    while start != -1:
        if text[start:] == text[: len(text) - start]:
            return text[:start]
        start = text.find(head, start + 1)
    return text


def split_corpus(text: str, held_out_fraction: float = HELD_OUT_FRACTION) -> tuple[str, str]:
    """Splits a corpus into (train, held_out); the only definition of that split.

    A trailing repeat of the text's beginning (at least 1,000 characters long) is dropped first, so
    `train + held_out` is the text without it. The held-out part is the last `held_out_fraction` of
    that, extended back to the start of the line it begins in (so it is at least that fraction).
    Training uses the train part and prompts come from the held-out part.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}.")
    text = _without_repeat(text)
    cut = len(text) - math.ceil(len(text) * held_out_fraction)
    boundary = text.rfind("\n", 0, cut) + 1
    if boundary == 0:
        boundary = text.find("\n", cut) + 1
    if boundary in (0, len(text)):
        raise ValueError(
            f"cannot split a text of {len(text)} characters at a line boundary with held_out_fraction="
            f"{held_out_fraction}: it needs a line break before the last {held_out_fraction:.0%}."
        )
    return text[:boundary], text[boundary:]


def load_corpora(corpora_dir: str | Path, part: Literal["train", "held_out"] = "train") -> dict[str, str]:
    """Reads the domain corpora (see CORPUS_DOMAINS) and returns one part of each: {domain: text}."""
    if part not in ("train", "held_out"):
        raise ValueError(f"part must be 'train' or 'held_out', got {part!r}.")
    corpora_dir = Path(corpora_dir)
    if not corpora_dir.is_dir():
        raise FileNotFoundError(
            f"{corpora_dir}: no such directory; expected a directory with {sorted(CORPUS_DOMAINS.values())}."
        )
    texts = {}
    for domain, name in CORPUS_DOMAINS.items():
        path = require_file(corpora_dir / name, f"the {domain!r} corpus as UTF-8 text")
        train, held_out = split_corpus(path.read_text(encoding="utf-8"))
        texts[domain] = train if part == "train" else held_out
    return texts


def _cut_prompt(text: str, start: int, min_chars: int, max_chars: int) -> str | None:
    """The longest piece of text[start:start + max_chars] ending at a line or sentence end, or None."""
    window = text[start : start + max_chars]
    ends = [m.end() for m in _PROMPT_END.finditer(window) if m.end() >= min_chars]
    if not ends and len(window) < max_chars and len(window) >= min_chars:
        ends = [len(window)]
    for end in reversed(ends):
        piece = window[:end].rstrip()
        if len(piece) >= min_chars:
            return piece
    return None


def domain_prompts(
    corpora_dir: str | Path,
    n_per_domain: int,
    min_chars: int = 200,
    max_chars: int = 600,
    seed: int = 0,
) -> list[Prompt]:
    """Prompts cut from the held-out part of each domain corpus; category is the domain.

    Each prompt starts at a line or sentence start, ends at a line or sentence end, has between
    `min_chars` and `max_chars` characters, and does not overlap the others. Start positions are tried
    in an order fixed by sha256(seed, domain, position), so the result depends only on the data and seed.
    """
    if n_per_domain < 1:
        raise ValueError(f"n_per_domain must be >= 1, got {n_per_domain}.")
    if not 0 < min_chars <= max_chars:
        raise ValueError(
            f"need 0 < min_chars <= max_chars, got min_chars={min_chars}, max_chars={max_chars}."
        )
    held_out = load_corpora(corpora_dir, "held_out")
    prompts = []
    for domain, text in held_out.items():
        starts = [0, *(m.end() for m in _PROMPT_START.finditer(text))]
        starts.sort(key=lambda s, d=domain: stable_key(seed, d, s))
        taken: list[tuple[int, int]] = []
        for start in starts:
            if len(taken) == n_per_domain:
                break
            piece = _cut_prompt(text, start, min_chars, max_chars)
            if piece is None or any(start < e and s < start + len(piece) for s, e in taken):
                continue
            taken.append((start, start + len(piece)))
            prompts.append(
                Prompt(
                    piece, source=Path(CORPUS_DOMAINS[domain]).stem, category=domain, uid=f"{domain}/{start}"
                )
            )
        if len(taken) < n_per_domain:
            raise ValueError(
                f"the held-out {domain!r} text ({len(text)} characters) gives only {len(taken)} prompts of "
                f"{min_chars}-{max_chars} characters, {n_per_domain} requested; ask for fewer or shorter "
                "prompts."
            )
    return prompts
