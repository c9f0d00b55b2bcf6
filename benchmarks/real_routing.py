"""The real decode routing of gpt-oss-20b (`../shared/data/routing/gpt-oss-20b/`, 477 requests, 24 MoE
layers of 32 experts, top 4) as an experiment workload, with the one store / validation / evaluation split
every experiment uses.

The split is by dataset, so that evaluation requests come from other datasets than the ones a policy learned
from or was tuned on, and no request is in two parts:

| part | datasets | requests | decode steps |
|---|---|---|---|
| store | mmlu_test | 201 | 61,020 |
| validation | mmlu_dev | 97 | 24,629 |
| evaluation | mmlu_validation, mmlu_pro_validation, Polyglot-or-Not_Fact-Completion, | 179 | 49,841 |
|   | tulu3_persona_if |   |   |

`store` is what offline-learning policies learn from (`Policy.from_traces`) and what warms an online store;
designs are chosen on `validation`; `evaluation` is only reported. `limit` takes an evenly spaced subset of a
part (request order of `requests.json`), so that a shorter replay still spans its categories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fmoe_jax.trace import RoutingTrace

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "gpt-oss-20b"
SPLIT: dict[str, tuple[str, ...]] = {
    "store": ("mmlu_test",),
    "validation": ("mmlu_dev",),
    "evaluation": (
        "mmlu_validation",
        "mmlu_pro_validation",
        "Polyglot-or-Not_Fact-Completion",
        "tulu3_persona_if",
    ),
}


def request_names(part: str, path: Path = DEFAULT_PATH, limit: int | None = None) -> list[str]:
    """The requests of one part of the split, in file order; `limit`: an evenly spaced subset of that many."""
    import json

    if part not in SPLIT:
        raise ValueError(f"unknown part {part!r} of the split; parts: {', '.join(SPLIT)}")
    records = json.loads((Path(path) / "requests.json").read_text())["requests"]
    return evenly([r["request"] for r in records if r["dataset"] in SPLIT[part]], limit)


def evenly(names: list[str], limit: int | None) -> list[str]:
    """`limit` of `names`, evenly spaced from the first to the last (all of them when `limit` is None)."""
    if limit is None or limit >= len(names):
        return names
    return [names[i] for i in np.linspace(0, len(names) - 1, limit).round().astype(int)]


def load(part: str, path: Path = DEFAULT_PATH, limit: int | None = None) -> RoutingTrace:
    """One part of the split as a `RoutingTrace` (one iteration per decode step; no prefill routing)."""
    return RoutingTrace.from_external(path, select=request_names(part, path, limit))


# -- as an experiment workload ------------------------------------------------------------------------------
# `--model` names experiments take for this routing: NAME@EXPERTS, the experts' precision the simulator
# charges at gpt-oss-20b's sizes (bf16, int4 or int8, or mxfp4 as published).
NAME = "gpt-oss-20b-routing"
PRECISIONS = {"bf16": None, "int8": "int8", "int4": "int4", "mxfp4": "mxfp4"}
# Policies that need what this routing does not hold (router inputs and weights, embeddings), and how an
# experiment runs them instead: mixtral_offload without its speculative gate (its cache rule alone); ProMoE's
# and DuoServe's predictors read router inputs, so they do not run.
WITHOUT_HIDDEN = {"mixtral_offload": ("mixtral_offload (no speculation)", (("speculate", False),))}


def is_routing(name: str) -> bool:
    """Whether an experiment's `--model` names this routing (`NAME` or `NAME@EXPERTS`)."""
    return name.partition("@")[0] == NAME


def workload(name: str, args: Any) -> Any:
    """The routing as a `harness.Workload` of simulated runs only: its store part learned from (every store
    request, `Policy.from_traces`; the first `--warmup` also replayed first), and `--routing-requests` of its
    evaluation part (`--split eval`) or validation part (`--split validation`) replayed, evenly spaced; at
    gpt-oss-20b's sizes with the experts in the precision `name` gives (default bf16)."""
    import dataclasses

    from fmoe_jax.offload.cost_model import GPT_OSS_20B

    from benchmarks import harness as h

    precision = name.partition("@")[2] or "bf16"
    if precision not in PRECISIONS:
        raise SystemExit(f"--model {name}: experts {precision!r}; choose one of {', '.join(PRECISIONS)}")
    part = "validation" if args.split == "validation" else "evaluation"
    path = data_path(args)
    replayed = load(part, path, limit=args.routing_requests)
    store = load("store", path)
    preset = dataclasses.replace(
        GPT_OSS_20B, name=f"gpt-oss-20b ({precision} experts)", expert_quantization=PRECISIONS[precision]
    )

    def requests(trace: Any) -> list[Any]:
        from fmoe_jax.trace import RoutingTrace

        records = trace.meta["requests"]
        return [
            h.Request(None, [], RoutingTrace({**trace.meta, "requests": [records[i]]}, [r]))
            for i, r in enumerate(trace.requests)
        ]

    return h.Workload(
        name=f"{NAME}@{precision}" + (" (validation)" if part == "validation" else ""),
        model=None,
        store=requests(store),
        eval=requests(replayed),
        preset=preset,
        router_weights=None,
        args=args,
        cache_dir=args.cache_dir / NAME,
        simulated_only=True,
        part=part,
    )


def data_path(args: Any) -> Path:
    """The routing set an experiment's `--routing-data` names (default: the shared gpt-oss-20b set)."""
    return Path(args.routing_data) if args.routing_data else DEFAULT_PATH


def settings_note(w: Any) -> str:
    """What an experiment replayed of this routing, for its notes."""
    a = w.args
    meta = w.eval[0].trace.meta
    steps = sum(len(r.trace.requests[0].iterations) for r in w.eval)
    total = len(request_names(w.part, data_path(a)))
    return (
        f"{w.name}: gpt-oss-20b's real decode routing ({meta['num_layers']} MoE layers x "
        f"{meta['num_experts']} experts, top-{meta['top_k']}; no embeddings, router inputs or prefill "
        "routing), split by dataset "
        f"(benchmarks/real_routing.py): policies learn from all {len(w.store)} store requests, the first "
        f"{a.warmup} also replayed first; {len(w.eval)} of the {total} {w.part} requests replayed "
        f"({steps:,} decode steps, each request a batch of one; TTFT means nothing here); "
        f"cache {w.slots(a.budget)} of {w.total_experts} experts ({a.budget:.0%}), "
        f"d = {a.prefetch_distance}, store capacity {a.store_capacity}; simulated at {w.sizes()} "
        f"({w.preset.expert_bytes / 2**20:.1f} MiB per expert), all {meta['num_layers']} of its "
        f"{w.preset.num_layers} MoE layers; fmoe matches on routing alone (semantic=False, no reuse "
        "predictor) and reads the token each step fed (token contexts); mixtral_offload runs without its "
        "speculative gate (no router inputs), ProMoE and "
        "DuoServe not at all"
    )
