"""Synthetic decode routing in regimes a policy must survive: topic-specific experts, token-to-token
persistence, both or neither. Used by `benchmarks/external_routing.py` and tests; never by serving.

The shipped tiny models route with strong, learnable structure (greedy decoding of small trained models),
so results on their traces say little about routing where prediction is hard. Production MoEs are
different: on real Mixtral-8x7B decode routing at a 25 % cache (issue 16), on-demand LRU kept 0.37 of
the accesses, LFU 0.31, Belady 0.60. This module draws routing whose structure is set by three knobs:

- `popularity`: the Dirichlet concentration of each layer's global expert popularity (large: uniform).
- `topic`: the concentration of each request's own expert distribution around the global one (small: every
  request prefers a few experts of its own, so a profile of other requests misleads).
- `persistence`: the chance, per layer and token, that the token's top choices lean towards the previous
  token's experts (temporal locality, which LRU exploits).

Routing per token and layer is a Gumbel-top-k draw from the request's distribution (with the previous
token's experts boosted when persistence applies); the mixing weights are the softmax of the drawn logits
over the chosen experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fmoe_jax.trace import RoutingTrace

# Logit added to the previous token's experts when persistence applies: large enough that they are
# nearly always among the top k then.
PERSISTENCE_BOOST = 5.0
# Draws behind each request's expert shares (`generate_with_shares`): a share's standard error <= 0.004.
SHARE_DRAWS = 16384


@dataclasses.dataclass(frozen=True)
class Regime:
    """Knobs of `generate` (see the module docstring)."""

    popularity: float
    topic: float
    persistence: float

    def __post_init__(self) -> None:
        if not (self.popularity > 0 and self.topic > 0):
            raise ValueError(
                f"popularity and topic are Dirichlet concentrations and must be > 0, got {self.popularity} "
                f"and {self.topic}"
            )
        if not 0 <= self.persistence <= 1:
            raise ValueError(f"persistence is a probability in [0, 1], got {self.persistence}")


# Named regimes. `heldout_like` was set (seed 0, Mixtral-8x7B's 32 x 8 experts, top 2, 64 cache slots) so
# that LRU keeps ~0.35 of the accesses, LFU a little less and Belady ~0.60, as on the held-out
# routing; the others each isolate one kind of structure.
REGIMES: dict[str, Regime] = {
    "heldout_like": Regime(popularity=5.0, topic=4.0, persistence=0.1),
    "recency": Regime(popularity=50.0, topic=50.0, persistence=0.3),  # uniform experts, sticky tokens
    "topic": Regime(popularity=1.0, topic=1.0, persistence=0.0),  # each request its own experts, no locality
    "topic_recency": Regime(popularity=1.0, topic=1.0, persistence=0.3),
}


def generate(regime: Regime, **kwargs: Any) -> list[RoutingTrace]:
    """One `RoutingTrace` per request (batch 1): a prefill iteration of `prompt_tokens` tokens, then a number
    of one-token decode iterations drawn from [decode_tokens[0], decode_tokens[1]). Ids and weights only
    (as `RoutingTrace.from_external` imports published routing): no embeddings, no router inputs. Keyword
    arguments: those of `generate_with_shares`."""
    return generate_with_shares(regime, **kwargs)[0]


def generate_with_shares(
    regime: Regime,
    *,
    requests: int,
    num_layers: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    prompt_tokens: int = 16,
    decode_tokens: tuple[int, int] = (48, 96),
    seed: int = 0,
) -> tuple[list[RoutingTrace], list[np.ndarray]]:
    """`generate`'s traces (the same ones), and what no causal policy is told: each request's chance that a
    token chooses each expert, `[L, J]` (its top k drawn from the request's own distribution, without the
    lean towards the previous token; estimated from `SHARE_DRAWS` draws of a separate generator, so the
    traces are unchanged). Keeping the experts a request chooses most often is the best eviction that does
    not see the future when tokens are drawn independently (`benchmarks/external_routing.py`'s bound)."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if prompt_tokens < 1 or not 1 <= decode_tokens[0] < decode_tokens[1]:
        raise ValueError(
            f"need prompt_tokens >= 1 and 1 <= decode_tokens[0] < decode_tokens[1], got {prompt_tokens} and "
            f"{decode_tokens}"
        )
    rng = np.random.default_rng(seed)
    popular = rng.dirichlet(np.full(num_experts, regime.popularity), size=num_layers)  # [L, J]
    meta = {"model_id": "synthetic", "regime": dataclasses.asdict(regime)}
    share_rng = np.random.default_rng([seed, 1])  # the shares' draws: `rng`'s sequence stays the traces'
    out, shares = [], []
    for _ in range(requests):
        # Each request's distribution: Dirichlet around the global one (a small floor keeps it defined).
        own = np.log(
            np.stack([rng.dirichlet(regime.topic * num_experts * p + 1e-3) for p in popular]) + 1e-12
        )  # [L, J] log-probabilities
        draws = own + share_rng.gumbel(size=(SHARE_DRAWS, *own.shape))  # [S, L, J]
        chosen = np.argsort(-draws, axis=-1, kind="stable")[..., :top_k]  # [S, L, k]
        counts = np.zeros(own.shape)
        np.add.at(counts, (np.arange(num_layers)[:, None], chosen), 1.0)
        shares.append(counts / SHARE_DRAWS)
        previous = None
        iterations = []
        for tokens in (prompt_tokens, *[1] * int(rng.integers(*decode_tokens))):
            ids = np.empty((tokens, num_layers, top_k), np.int32)
            weights = np.empty((tokens, num_layers, top_k), np.float32)
            for t in range(tokens):
                logits = own + rng.gumbel(size=own.shape)  # [L, J]
                if previous is not None:
                    sticky = rng.random(num_layers) < regime.persistence  # [L]
                    np.put_along_axis(
                        logits,
                        previous,
                        np.take_along_axis(logits, previous, -1) + PERSISTENCE_BOOST * sticky[:, None],
                        -1,
                    )
                chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]  # [L, k]
                top = np.take_along_axis(logits, chosen, -1)
                mix = np.exp(top - top.max(-1, keepdims=True))
                ids[t], weights[t] = chosen, mix / mix.sum(-1, keepdims=True)
                previous = chosen
            iterations.append({"ids": ids, "weights": weights})
        out.append(RoutingTrace.from_external([iterations], num_experts=num_experts, meta=meta))
    return out, shares
