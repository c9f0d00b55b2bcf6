"""Readers of routing recorded outside fmoe_jax, for `RoutingTrace.from_external(path)` (`offload/trace.py`).

Two formats:
- a *routing set* directory: `decode_routing.npz` (per request `<name>__ids` `[T, L, k]`, optional
  `<name>__w` `[T, L, k]` weights and `<name>__pos` `[T]` positions) and `requests.json` (`num_experts` and
  `requests`, a list of dicts naming each `request`, with any other fields such as `dataset`, and optionally
  `tokens`, the strings of the tokens at each position), as the shared gpt-oss-20b set
  (`../shared/data/routing/gpt-oss-20b/`) is stored;
- a JSONL file of `{"request", "step", "layer", "experts", "weights", "token"}` records (`weights` and the fed
  token's id `token` optional), one per token and layer (the easiest thing to write from a forward hook on a
  transformers or vLLM model; README, "Bring your routing").

Both hold decode steps one token each: every step becomes an iteration of one token, and a request's first
step stands in for its prefill (the simulator's TTFT of such a trace means nothing; TPOT does). Where the
fed token of each step is known, its iteration carries it (`tokens`): a routing set's token strings (at
`__pos`) as `token_id`s, a JSONL file's ids as given.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

ROUTING_ARRAYS = "decode_routing.npz"
REQUESTS = "requests.json"


def read_external(
    path: str | os.PathLike,
    *,
    num_experts: int | None = None,
    select: Callable[[dict[str, Any]], bool] | Iterable[str] | None = None,
) -> tuple[list[list[dict[str, np.ndarray]]], dict[str, Any]]:
    """(per request, per iteration, `{"ids", "weights"}`; meta) from a routing-set directory or a JSONL file.

    Args:
      path: the directory or the `.jsonl` file.
      num_experts: J; a routing set's `requests.json` gives it, a JSONL file needs it.
      select: which requests to read: request names, or a predicate on each request's record (a routing
        set's `requests.json` entry; for JSONL `{"request": name}`). Default: all, in file order.

    `meta["requests"]` lists the records of the requests read, in order (name, dataset, ...).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"routing data {path}: no such file or directory")
    if path.is_dir():
        return _read_routing_set(path, num_experts, _selector(select))
    if path.suffix == ".jsonl":
        if num_experts is None:
            raise ValueError(f"routing data {path}: a JSONL file needs num_experts (J) to be given")
        return _read_jsonl(path, num_experts, _selector(select))
    raise ValueError(
        f"routing data {path}: expected a directory holding {ROUTING_ARRAYS} and {REQUESTS}, or a .jsonl file"
    )


def _selector(select: Any) -> Callable[[dict[str, Any]], bool]:
    if select is None:
        return lambda record: True
    if callable(select):
        return select
    names = set(select)
    return lambda record: record["request"] in names


def _read_routing_set(directory: Path, num_experts: int | None, keep: Callable) -> tuple[list, dict]:
    for name in (ROUTING_ARRAYS, REQUESTS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"routing set {directory}: missing {name}")
    try:
        header = json.loads((directory / REQUESTS).read_text())
        records = header["requests"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"routing set {directory}: {REQUESTS} is not a JSON object with 'requests'") from err
    recorded = header.get("num_experts")
    if recorded is not None and num_experts is not None and recorded != num_experts:
        raise ValueError(
            f"routing set {directory}: {REQUESTS} says {recorded} experts a layer, not {num_experts}"
        )
    num_experts = recorded if recorded is not None else num_experts
    if num_experts is None:
        raise ValueError(f"routing set {directory}: {REQUESTS} has no num_experts; pass num_experts")
    chosen = [r for r in records if keep(r)]
    arrays = np.load(directory / ROUTING_ARRAYS)
    requests = []
    for record in chosen:
        name = record["request"]
        if f"{name}__ids" not in arrays.files:
            raise ValueError(
                f"routing set {directory}: {ROUTING_ARRAYS} has no {name}__ids for request {name}"
            )
        ids = arrays[f"{name}__ids"]  # [T, L, k]
        weights = arrays[f"{name}__w"] if f"{name}__w" in arrays.files else None  # [T, L, k]
        if weights is not None and weights.shape != ids.shape:
            raise ValueError(
                f"routing set {directory}: {name}__w has shape {weights.shape}, {name}__ids {ids.shape}"
            )
        requests.append(_steps(ids, weights, _fed_tokens(record, arrays, name, len(ids))))
    meta = {key: header[key] for key in ("model", "num_moe_layers") if key in header}
    meta["requests"] = [{k: v for k, v in r.items() if k not in ("tokens", "prompt")} for r in chosen]
    meta["source"] = str(directory)
    return requests, {**meta, "num_experts": int(num_experts)}


def token_id(text: str) -> int:
    """A routing set's token string as a token id: a stable 63-bit hash (the set holds strings, not the
    tokenizer's ids; equal strings get equal ids, and distinct ones collide with odds of ~1e-10 in a
    vocabulary of 200k)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _fed_tokens(record: dict[str, Any], arrays: Any, name: str, steps: int) -> np.ndarray | None:
    """The token fed at each decode step (`tokens[pos]`, as `token_id`s), where the set records both."""
    strings = record.get("tokens")
    if not isinstance(strings, list) or f"{name}__pos" not in arrays.files:
        return None
    pos = np.asarray(arrays[f"{name}__pos"], np.int64)
    if pos.shape != (steps,) or pos.min(initial=0) < 0 or pos.max(initial=0) >= len(strings):
        return None  # positions that do not index the strings: no tokens rather than wrong ones
    return np.array([token_id(strings[p]) for p in pos.tolist()], np.int64)


def _steps(
    ids: np.ndarray, weights: np.ndarray | None, tokens: np.ndarray | None = None
) -> list[dict[str, np.ndarray]]:
    """One iteration of one token per decode step."""
    ids = np.asarray(ids, np.int32)
    weights = None if weights is None else np.asarray(weights, np.float32)
    steps = []
    for t in range(ids.shape[0]):
        step = {"ids": ids[t : t + 1]}
        if weights is not None:
            step["weights"] = weights[t : t + 1]
        if tokens is not None:
            step["tokens"] = tokens[t : t + 1]
        steps.append(step)
    return steps


def _read_jsonl(path: Path, num_experts: int, keep: Callable) -> tuple[list, dict]:
    steps: dict[str, dict[int, dict[int, tuple]]] = collections.OrderedDict()
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                request, step, layer = str(record["request"]), int(record["step"]), int(record["layer"])
                experts = [int(e) for e in record["experts"]]
                weights = record.get("weights")
                weights = None if weights is None else [float(w) for w in weights]
                token = record.get("token")
                token = None if token is None else int(token)
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"routing data {path}, line {line_no}: expected a JSON object with request, step, layer, "
                    f"experts (and optionally weights, token): {err}"
                ) from None
            if weights is not None and len(weights) != len(experts):
                raise ValueError(
                    f"routing data {path}, line {line_no}: {len(weights)} weights, {len(experts)} experts"
                )
            if not keep({"request": request}):
                continue
            steps.setdefault(request, {}).setdefault(step, {})[layer] = (experts, weights, token)
    if not steps:
        raise ValueError(f"routing data {path}: no routing records (of the selected requests)")
    requests = [_jsonl_request(path, name, by_step) for name, by_step in steps.items()]
    meta = {
        "requests": [{"request": name} for name in steps],
        "source": str(path),
        "num_experts": num_experts,
    }
    return requests, meta


def _jsonl_request(
    path: Path, name: str, by_step: dict[int, dict[int, tuple]]
) -> list[dict[str, np.ndarray]]:
    layers = 1 + max(max(records) for records in by_step.values())
    ids, weights, tokens = [], [], []
    for step in sorted(by_step):
        records = by_step[step]
        if sorted(records) != list(range(layers)):
            raise ValueError(
                f"routing data {path}: request {name} step {step} has layers {sorted(records)}, "
                f"expected 0..{layers - 1}"
            )
        ids.append([records[layer][0] for layer in range(layers)])
        weights.append([records[layer][1] for layer in range(layers)])
        tokens.append(next((r[2] for r in records.values() if r[2] is not None), None))
    try:
        ids_array = np.asarray(ids, np.int32)  # [T, L, k]
    except ValueError:
        raise ValueError(
            f"routing data {path}: request {name} routes to different numbers of experts"
        ) from None
    has_weights = all(w is not None for step in weights for w in step)
    fed = np.asarray(tokens, np.int64) if all(t is not None for t in tokens) else None
    return _steps(ids_array, np.asarray(weights, np.float32) if has_weights else None, fed)
