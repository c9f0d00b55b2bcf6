"""A routing trace of fewer MoE layers than the model it is simulated at, projected onto all of them.

The simulator replays a trace's own layers; a trace recorded on an 8-layer model replayed "at Mixtral-8x7B
sizes" is then a quarter of Mixtral-8x7B. `fit_layers` (`simulate(..., layers=...)`) says what happens:
"project" replays the whole model, "refuse" raises, "trace" keeps the trace's layers (the old behaviour).

Projection: model layer m replays trace layer `m * L_trace // L_model` (each trace layer serves a run of
consecutive model layers, in order), and the c-th copy of a trace layer has its expert ids (and probability
columns) permuted by a fixed permutation of its own (copy 0 unpermuted). The cache keys experts by layer, so
copies never share residency; the permutation keeps a policy from learning that copy c routes like copy 0
by expert id. Sequential correlations between adjacent layers are those of the trace layers they copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .trace import RoutingTrace

MODES = ("project", "refuse", "trace")


def fit_layers(traces: Sequence[RoutingTrace], model_layers: int, mode: str) -> list[RoutingTrace]:
    """`traces` as replayed at a model of `model_layers` MoE layers (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"layers must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    traces = list(traces)
    if mode == "trace" or not traces:
        return traces
    have = traces[0].meta.get("num_layers")
    if have == model_layers:
        return traces
    if mode == "refuse" or have > model_layers:
        raise ValueError(
            f"the routing trace has {have} MoE layers but the model preset has {model_layers}; pass "
            "layers='project' to replay it at the whole model's layers, or layers='trace' for the trace's own"
            if have < model_layers
            else f"the routing trace has {have} MoE layers, more than the model preset's {model_layers}"
        )
    return [project(trace, model_layers) for trace in traces]


def project(trace: RoutingTrace, model_layers: int, seed: int = 0) -> RoutingTrace:
    """The trace on `model_layers` MoE layers; `meta["trace_layers"]` keeps its own count."""
    have, experts = trace.meta["num_layers"], trace.meta["num_experts"]
    source = np.arange(model_layers) * have // model_layers  # [L_model] trace layer of each model layer
    copy = np.arange(model_layers) - np.searchsorted(source, source)  # which copy of its trace layer
    rng = np.random.default_rng(seed)
    perms = [np.arange(experts)] + [rng.permutation(experts) for _ in range(int(copy.max()))]
    perm = np.stack([perms[c] for c in copy])  # [L_model, J] new id of each expert
    inverse = np.argsort(perm, axis=1)  # [L_model, J] old id at each new place
    layers = np.arange(model_layers)

    def expand(it):
        ids = perm[layers[None, :, None], it.ids[:, source]].astype(np.int32)
        probs = None if it.probs is None else it.probs[:, source][:, layers[:, None], inverse]
        return dataclasses.replace(
            it,
            ids=ids,
            probs=probs,
            weights=None if it.weights is None else it.weights[:, source],
            hidden=None if it.hidden is None else it.hidden[:, source],
        )

    requests = [
        dataclasses.replace(r, iterations=[expand(it) for it in r.iterations]) for r in trace.requests
    ]
    meta = {**trace.meta, "num_layers": model_layers, "trace_layers": trace.meta.get("trace_layers", have)}
    return RoutingTrace(meta, requests)
