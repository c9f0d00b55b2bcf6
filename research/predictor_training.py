"""Evaluation of the learned expert predictors (`promoe`, `duoserve`): top-k accuracy on held-out traces
against the popularity baseline. Research code: `benchmarks/train_predictors.py` calls it. Training lives
with the policies that train at start (`fmoe_jax.offload.predictor_training`), re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from fmoe_jax.offload.predictor_training import (
    duoserve_dataset,
    multi_hot,
    promoe_dataset,
    require_fields,
    reuse_dataset,
    routing_statistics,
    split_requests,
    train_duoserve,
    train_promoe,
    train_reuse,
)
from fmoe_jax.offload.predictors import Predictor

__all__ = [
    "duoserve_dataset",
    "evaluate",
    "multi_hot",
    "promoe_dataset",
    "require_fields",
    "reuse_dataset",
    "routing_statistics",
    "split_requests",
    "top_k_scores",
    "train_duoserve",
    "train_promoe",
    "train_reuse",
]


# -- evaluation ------------------------------------------------------------------------------------------
def top_k_scores(probs: np.ndarray, truth: np.ndarray, k: int) -> dict[str, float]:
    """How the top-k of `probs` `[M, J]` covers the true multi-hot `truth` `[M, J]`: recall (share of true
    experts predicted), all_hit (every true expert predicted, DuoServe's "top-k" column) and any_hit."""
    pred = multi_hot(np.argsort(-probs, axis=-1, kind="stable")[:, :k], probs.shape[-1])
    hit = (pred * truth).sum(-1)
    need = np.maximum(truth.sum(-1), 1.0)
    return {
        "recall": float((hit / need).mean()),
        "all_hit": float((hit >= need).mean()),
        "any_hit": float((hit > 0).mean()),
    }


def evaluate(
    predictor: Predictor, traces: Sequence[Any], *, max_samples: int | None = None
) -> dict[str, Any]:
    """Top-k accuracy of `predictor` on (held-out) traces, next to the popularity baseline that predicts
    each layer's k most popular experts (popularity from the predictor's training traces)."""
    traces = list(traces)
    k = predictor.meta["top_k"]
    if predictor.kind == "promoe":
        x, y = promoe_dataset(traces, predictor.meta["stride"], max_tokens=max_samples)
        probs = np.stack([predictor.probs(x[t], t) for t in range(x.shape[0])])
        probs, truth = probs.reshape(-1, probs.shape[-1]), y.reshape(-1, y.shape[-1])
        targets = np.repeat(np.arange(x.shape[0]), x.shape[1])
    else:
        x, truth, targets = duoserve_dataset(
            traces, predictor.popularity, predictor.affinity, max_samples=max_samples
        )
        probs = predictor.probs(x)
    baseline = top_k_scores(predictor.popularity[targets], truth, k)
    return {
        **top_k_scores(probs, truth, k),
        **{f"popularity_{name}": value for name, value in baseline.items()},
        "samples": int(truth.shape[0]),
    }
