"""Routing traces: per request and iteration, the semantic embeddings and every MoE layer's routing.

`generate(..., record_trace=True)` fills one; policies learn from traces (offline expert-map stores) and
the simulator replays them. Saved as `.npz` (arrays) + `.json` (header). `RoutingTrace.from_external`
builds one from published routing data (top-k ids and weights per token and layer, probabilities optional).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .files import write_atomically

FORMAT_VERSION = 1


@dataclasses.dataclass
class Iteration:
    """One iteration (prefill: the prompt tokens; decode: one token) of one request."""

    ids: np.ndarray  # [t, L, k] int32 chosen experts per MoE layer
    probs: np.ndarray | None = None  # [t, L, J] float32 router probabilities (the expert maps)
    embeds: np.ndarray | None = None  # [t, H] float32 embedding-layer output (semantic context)
    weights: np.ndarray | None = None  # [t, L, k] float32 mixing weights, when known
    hidden: np.ndarray | None = None  # [t, L, D] float32 router inputs, when recorded (learned predictors)
    tokens: np.ndarray | None = None  # [t] int64 the token ids fed, when known (fmoe's token contexts)

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


@dataclasses.dataclass
class RequestTrace:
    prompt: list[int]
    iterations: list[Iteration] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RoutingTrace:
    """Routing of a set of requests. `meta` holds num_layers (MoE layers), num_experts, top_k, embed_dim,
    and whatever identifies the model (family, source)."""

    meta: dict[str, Any]
    requests: list[RequestTrace]

    @classmethod
    def empty(cls, cfg, prompts: Sequence[list[int]]) -> RoutingTrace:
        from fmoe_jax.models import model_identity

        meta = dict(
            model_id=model_identity(cfg),
            family=cfg.family,
            num_layers=cfg.num_moe_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            embed_dim=cfg.hidden_size,
        )
        return cls(meta, [RequestTrace(list(p)) for p in prompts])

    def add_iteration(self, step_out, valid: np.ndarray, tokens: np.ndarray | None = None) -> None:
        """Appends one engine step's recorded routing (`fmoe_jax.engines.Recorded`); `valid` `[B, T]` marks
        real (unpadded, active) tokens; `tokens` `[B, T]`, the token ids the step fed."""
        embeds = np.asarray(step_out.embeds, np.float32)  # [B, T, H]
        probs = np.asarray(step_out.probs, np.float32)  # [B, T, L, J]
        ids = np.asarray(step_out.ids, np.int32)  # [B, T, L, k]
        hidden = None if step_out.hidden is None else np.asarray(step_out.hidden, np.float32)  # [B, T, L, D]
        valid = np.broadcast_to(valid, ids.shape[:2])
        fed = None if tokens is None else np.asarray(tokens, np.int64).reshape(ids.shape[:2])
        for b, request in enumerate(self.requests):
            rows = valid[b]
            if rows.any():
                request.iterations.append(
                    Iteration(
                        ids=ids[b, rows],
                        probs=probs[b, rows],
                        embeds=embeds[b, rows],
                        hidden=None if hidden is None else hidden[b, rows],
                        tokens=None if fed is None else fed[b, rows],
                    )
                )

    # -- external data ---------------------------------------------------------------------------------
    @classmethod
    def from_external(
        cls,
        requests: Sequence[Sequence[dict[str, np.ndarray]]] | str | os.PathLike,
        *,
        num_experts: int | None = None,
        meta: dict[str, Any] | None = None,
        select: Any = None,
    ) -> RoutingTrace:
        """Builds a trace from routing data recorded elsewhere.

        Args:
          requests: per request, per iteration, a dict with `ids` `[t, L, k]` (required), and optionally
            `weights` `[t, L, k]`, `probs` `[t, L, J]`, `embeds` `[t, H]`, `tokens` `[t]` (the token ids
            fed); or the path of a routing-set
            directory or a JSONL file (`offload/trace_formats.py`: one iteration per decode step, and
            `meta["requests"]` lists each request's record, its dataset for instance).
          num_experts: J (a routing set's `requests.json` gives it). Without probabilities, policies that
            need them see a distribution with the given weights (or 1/k) on the chosen experts and zero
            elsewhere.
          select: with a path, the requests to read: names, or a predicate on each request's record.
        """
        if isinstance(requests, (str, os.PathLike)):
            from .trace_formats import read_external

            requests, read_meta = read_external(requests, num_experts=num_experts, select=select)
            num_experts = read_meta.pop("num_experts")
            meta = {**read_meta, **(meta or {})}
        elif select is not None:
            raise ValueError("select= picks requests of a file; pass only the requests you want instead")
        if num_experts is None:
            raise ValueError("from_external needs num_experts (J) for routing given as arrays")
        out = []
        top_k = None
        embed_dim = 0
        num_layers = None
        for r, iterations in enumerate(requests):
            req = RequestTrace(prompt=[])
            for i, it in enumerate(iterations):
                if "ids" not in it:
                    raise ValueError(f"request {r} iteration {i}: 'ids' [t, L, k] is required")
                ids = np.asarray(it["ids"], np.int32)
                if ids.ndim != 3:
                    raise ValueError(
                        f"request {r} iteration {i}: ids must be [t, L, k], got shape {ids.shape}"
                    )
                if ids.min() < 0 or ids.max() >= num_experts:
                    raise ValueError(f"request {r} iteration {i}: expert ids outside [0, {num_experts})")
                top_k = top_k or ids.shape[2]
                num_layers = num_layers or ids.shape[1]
                if ids.shape[1:] != (num_layers, top_k):
                    raise ValueError(
                        f"request {r} iteration {i}: ids shape {ids.shape} does not match "
                        f"[t, {num_layers}, {top_k}] of earlier iterations"
                    )
                weights = it.get("weights")
                weights = None if weights is None else np.asarray(weights, np.float32)
                probs = it.get("probs")
                if probs is None:
                    probs = np.zeros((*ids.shape[:2], num_experts), np.float32)
                    w = weights if weights is not None else np.full(ids.shape, 1.0 / ids.shape[2], np.float32)
                    np.put_along_axis(probs, ids, w, axis=-1)
                embeds = it.get("embeds")
                if embeds is not None:
                    embeds = np.asarray(embeds, np.float32)
                    embed_dim = embeds.shape[-1]
                tokens = it.get("tokens")
                if tokens is not None:
                    tokens = np.asarray(tokens, np.int64)
                    if tokens.shape != ids.shape[:1]:
                        raise ValueError(
                            f"request {r} iteration {i}: tokens must be [t], got shape {tokens.shape}"
                        )
                iteration = Iteration(ids, np.asarray(probs, np.float32), embeds, weights, tokens=tokens)
                req.iterations.append(iteration)
            out.append(req)
        base = dict(
            num_layers=num_layers or 0,
            num_experts=num_experts,
            top_k=top_k or 0,
            embed_dim=embed_dim,
            source="external",
        )
        return cls({**base, **(meta or {})}, out)

    # -- persistence -------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Writes `path.npz` and `path.json` (path given without extension, or with either one)."""
        stem = _stem(path)
        arrays: dict[str, np.ndarray] = {}
        index = []
        for r, req in enumerate(self.requests):
            arrays[f"r{r}_prompt"] = np.asarray(req.prompt, np.int32)
            for i, it in enumerate(req.iterations):
                for name in ("ids", "probs", "embeds", "weights", "hidden", "tokens"):
                    value = getattr(it, name)
                    if value is not None:
                        arrays[f"r{r}_i{i}_{name}"] = value
            index.append(len(req.iterations))
        header = dict(format_version=FORMAT_VERSION, meta=self.meta, iterations_per_request=index)
        write_atomically(stem.with_suffix(".npz"), lambda f: np.savez(f, **arrays))
        text = json.dumps(header, indent=1).encode()
        write_atomically(stem.with_suffix(".json"), lambda f: f.write(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        stem = _stem(path)
        try:
            header = json.loads(stem.with_suffix(".json").read_text())
            data = np.load(stem.with_suffix(".npz"))
        except FileNotFoundError as err:
            raise FileNotFoundError(f"routing trace {stem}: missing {err.filename}") from None
        if header.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"routing trace {stem}: format_version {header.get('format_version')} is not {FORMAT_VERSION}"
            )
        requests = []
        for r, n in enumerate(header["iterations_per_request"]):
            req = RequestTrace(prompt=data[f"r{r}_prompt"].tolist())
            for i in range(n):

                def get(name, r=r, i=i):
                    key = f"r{r}_i{i}_{name}"
                    return data[key] if key in data.files else None

                req.iterations.append(
                    Iteration(
                        get("ids"), get("probs"), get("embeds"), get("weights"), get("hidden"), get("tokens")
                    )
                )
            requests.append(req)
        return cls(header["meta"], requests)


def _stem(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".npz", ".json") else path
