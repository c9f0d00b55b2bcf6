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

import numpy as np

from fmoe_jax.trace import RoutingTrace

DEFAULT_PATH = Path("../shared/data/routing/gpt-oss-20b")
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
    names = [r["request"] for r in records if r["dataset"] in SPLIT[part]]
    if limit is not None and limit < len(names):
        names = [names[i] for i in np.linspace(0, len(names) - 1, limit).round().astype(int)]
    return names


def load(part: str, path: Path = DEFAULT_PATH, limit: int | None = None) -> RoutingTrace:
    """One part of the split as a `RoutingTrace` (one iteration per decode step; no prefill routing)."""
    return RoutingTrace.from_external(path, select=request_names(part, path, limit))
