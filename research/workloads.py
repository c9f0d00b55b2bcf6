"""Request workloads for experiments: prompt sets, Azure arrival traces and domain corpora (the corpora and
their split are `fmoe_jax.corpora`'s, which the demo reads too).

Called by benchmarks and training scripts; every loader takes the data path (see ../shared/data/README.md).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fmoe_jax.corpora import (
    CORPUS_DOMAINS,
    HELD_OUT_FRACTION,
    Prompt,
    domain_prompts,
    load_corpora,
    require_file,
    split_corpus,
    stable_key,
)

__all__ = [  # the corpora's names are `fmoe_jax.corpora`'s, here for the experiments that read them
    "CORPUS_DOMAINS",
    "HELD_OUT_FRACTION",
    "ArrivalTrace",
    "Prompt",
    "domain_prompts",
    "load_alpaca_eval",
    "load_azure_arrivals",
    "load_corpora",
    "load_mt_bench",
    "load_sharegpt",
    "split_corpus",
    "split_store_eval",
]

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


# ---------------------------------------------------------------------------------------------------------
# Prompt sets
# ---------------------------------------------------------------------------------------------------------


def _read_json_list(path: str | Path, expected: str) -> list[Any]:
    path = require_file(path, expected)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); expected {expected}.") from e
    if not isinstance(rows, list):
        raise ValueError(f"{path}: top level is {type(rows).__name__}; expected {expected}.")
    return rows


def _field(row: Any, key: str, kind: type, where: str, expected: str) -> Any:
    value = row.get(key) if isinstance(row, dict) else None
    if not isinstance(value, kind):
        raise ValueError(f"{where}: field {key!r} is missing or not a {kind.__name__}; expected {expected}.")
    return value


def load_mt_bench(path: str | Path) -> list[Prompt]:
    """MT-Bench questions (jsonl with `question_id`, `category`, `turns`); the first turn is the text."""
    expected = "MT-Bench jsonl lines with 'question_id', 'category' and a non-empty list 'turns'"
    path = require_file(path, expected)
    prompts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); expected {expected}.") from e
        turns = _field(row, "turns", list, where, expected)
        if not turns or not isinstance(turns[0], str):
            raise ValueError(f"{where}: 'turns' has no first turn as a string; expected {expected}.")
        category = _field(row, "category", str, where, expected)
        qid = _field(row, "question_id", int, where, expected)
        prompts.append(Prompt(text=turns[0], source="mt_bench", category=category, uid=f"mt_bench/{qid}"))
    return prompts


def load_sharegpt(path: str | Path) -> list[Prompt]:
    """ShareGPT prompts (a JSON list of `{id, conversations: [{from, value}]}`); skips empty first turns."""
    expected = (
        "a ShareGPT JSON list of objects with 'id' and a non-empty list 'conversations' of {'value': str}"
    )
    rows = _read_json_list(path, expected)
    prompts = []
    for i, row in enumerate(rows):
        where = f"{path}, item {i}"
        conversations = _field(row, "conversations", list, where, expected)
        if not conversations:
            raise ValueError(f"{where}: 'conversations' is empty; expected {expected}.")
        text = _field(conversations[0], "value", str, f"{where}, conversations[0]", expected)
        if not text.strip():
            continue
        uid = _field(row, "id", str, where, expected)
        prompts.append(Prompt(text=text, source="sharegpt", category="chat", uid=f"sharegpt/{uid}"))
    return prompts


def load_alpaca_eval(path: str | Path) -> list[Prompt]:
    """AlpacaEval instructions (a JSON list of `{instruction, dataset, ...}`); category is `dataset`."""
    expected = "an AlpacaEval JSON list of objects with string fields 'instruction' and 'dataset'"
    rows = _read_json_list(path, expected)
    prompts = []
    for i, row in enumerate(rows):
        where = f"{path}, item {i}"
        text = _field(row, "instruction", str, where, expected)
        category = _field(row, "dataset", str, where, expected)
        prompts.append(Prompt(text=text, source="alpaca_eval", category=category, uid=f"alpaca_eval/{i}"))
    return prompts


# ---------------------------------------------------------------------------------------------------------
# Deterministic ordering and the store/eval split
# ---------------------------------------------------------------------------------------------------------


def split_store_eval(
    prompts: Sequence[Prompt], store_fraction: float = 0.7, seed: int = 0
) -> tuple[list[Prompt], list[Prompt]]:
    """Splits prompts into a store set (builds expert maps) and an eval set, deterministically by uid hash.

    The store set gets round(len(prompts) * store_fraction) prompts. Each category contributes
    floor(n_c * store_fraction) prompts plus at most one more (largest remainders first), so categories
    keep the proportion up to one prompt. Within a category the prompts with the smallest
    sha256(seed, uid) go to the store. Both lists keep the input order.
    """
    if not 0.0 <= store_fraction <= 1.0:
        raise ValueError(f"store_fraction must be in [0, 1], got {store_fraction}.")
    uids = [p.uid for p in prompts]
    if len(set(uids)) != len(uids):
        duplicates = sorted({u for u in uids if uids.count(u) > 1})[:5]
        raise ValueError(f"prompt uids must be unique for a disjoint split; repeated: {duplicates}.")

    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    quota = {c: math.floor(len(ps) * store_fraction) for c, ps in by_category.items()}
    n_extra = round(len(prompts) * store_fraction) - sum(quota.values())
    remainders = sorted(
        by_category,
        key=lambda c: (-(len(by_category[c]) * store_fraction - quota[c]), stable_key(seed, "category", c)),
    )
    for c in remainders[:n_extra]:
        quota[c] += 1

    store_uids = set()
    for c, ps in by_category.items():
        ranked = sorted(ps, key=lambda p: stable_key(seed, p.uid))
        store_uids.update(p.uid for p in ranked[: quota[c]])
    store = [p for p in prompts if p.uid in store_uids]
    evaluation = [p for p in prompts if p.uid not in store_uids]
    return store, evaluation


# ---------------------------------------------------------------------------------------------------------
# Arrival traces
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class ArrivalTrace:
    """Request arrivals with their input and output lengths, one entry per request.

    Attributes:
      arrival_s: [R] float64 seconds since the first request, non-decreasing.
      context_tokens: [R] int64 prompt lengths from the trace.
      generated_tokens: [R] int64 output lengths from the trace.
    """

    arrival_s: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    def __post_init__(self) -> None:
        shapes = {a.shape for a in (self.arrival_s, self.context_tokens, self.generated_tokens)}
        if len(shapes) != 1 or self.arrival_s.ndim != 1:
            raise ValueError(
                "arrival_s, context_tokens and generated_tokens must be 1-D of one length, got shapes "
                f"{self.arrival_s.shape}, {self.context_tokens.shape}, {self.generated_tokens.shape}."
            )
        if np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrival_s must be non-decreasing.")

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    def assign(
        self, prompts: Sequence[Prompt], seed: int, max_generated_tokens: int | None = None
    ) -> list[tuple[float, Prompt, int]]:
        """Pairs each arrival with a prompt: (arrival time in s, prompt, tokens to generate).

        Prompts are taken in an order fixed by sha256(seed, pass, uid); with more arrivals than prompts,
        each further pass over the prompts is reshuffled. The token count is the trace's, clipped to
        [1, max_generated_tokens].
        """
        if not prompts:
            raise ValueError("assign needs at least one prompt.")
        if max_generated_tokens is not None and max_generated_tokens < 1:
            raise ValueError(f"max_generated_tokens must be >= 1 or None, got {max_generated_tokens}.")
        order: list[Prompt] = []
        n_pass = 0
        while len(order) < len(self):
            order.extend(sorted(prompts, key=lambda p, n=n_pass: stable_key(seed, n, p.uid)))
            n_pass += 1
        generated = np.clip(self.generated_tokens, 1, max_generated_tokens)
        return [
            (float(t), p, int(g))
            for t, p, g in zip(self.arrival_s, order[: len(self)], generated, strict=True)
        ]


def load_azure_arrivals(path: str | Path, time_scale: float = 1.0, limit: int | None = None) -> ArrivalTrace:
    """Loads an Azure LLM inference trace (2023) CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`.

    Args:
      path: the CSV file; TIMESTAMP is a datetime string such as `2023-11-16 18:17:03.9799600`.
      time_scale: multiplies every inter-arrival time (0.5 replays the trace twice as fast).
      limit: keep only the first `limit` rows of the file.

    Rows are ordered by TIMESTAMP (the published traces already are).
    """
    expected = f"an Azure LLM trace CSV with header {','.join(_AZURE_COLUMNS)}"
    path = require_file(path, expected)
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}.")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}.")

    stamps, context, generated = [], [], []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{path}: header {reader.fieldnames} lacks columns {missing}; expected {expected}."
            )
        for row in reader:
            if limit is not None and len(stamps) == limit:
                break
            where = f"{path}, line {reader.line_num}"
            try:
                stamps.append(np.datetime64(row["TIMESTAMP"].strip(), "ns"))
                context.append(int(row["ContextTokens"]))
                generated.append(int(row["GeneratedTokens"]))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{where}: malformed row {row} ({e}); expected {expected}.") from e
    if not stamps:
        raise ValueError(f"{path}: no requests; expected {expected}.")

    times = np.array(stamps, dtype="datetime64[ns]")
    order = np.argsort(times, kind="stable")
    offsets_ns = (times[order] - times[order[0]]).astype(np.int64)
    return ArrivalTrace(
        arrival_s=offsets_ns.astype(np.float64) * 1e-9 * time_scale,
        context_tokens=np.asarray(context, dtype=np.int64)[order],
        generated_tokens=np.asarray(generated, dtype=np.int64)[order],
    )
