"""The fmoe policy's parts that learn from routing outcomes, built when it binds to a cache (`build`):
popularity, the reuse forecast, the guides over them, eviction and the learned predictor's reuse scores; and
what of them a saved store keeps (`attachments`). Called by `policy.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...cache import CacheView
from ...predictors import Predictor
from ..base import PolicyContext
from .admission import Admission
from .distance import DistanceForecast
from .eviction import Eviction, Popularity, PredictedReuse
from .forecast import Calibration, ReuseForecast
from .guides import Guides
from .next_use import NextUseTraining
from .options import FMoEOptions
from .select import SortedMaps


@dataclasses.dataclass
class Parts:
    popularity: Popularity
    forecast: ReuseForecast | DistanceForecast  # (or `NextUseTraining`'s learned forecast)
    sorted_maps: SortedMaps  # the maps the matcher matched lately, sorted for selection
    guides: Guides
    evictor: Eviction
    predicted: PredictedReuse | None  # the learned reuse predictor's scores, where there is one


def build(
    options: FMoEOptions,
    ctx: PolicyContext,
    cache: CacheView,
    admission: Admission,
    *,
    saved: dict[str, Any],
    calibration: Calibration,
    next_calibration: Calibration,
    reuse_horizon: int,
    reuse_predictor: Predictor | None,
    next_use: NextUseTraining | None,
    distance_counts: np.ndarray | None,
) -> Parts:
    """The parts for `options` at `ctx`'s shapes. The calibrations, the forecast and popularity start from
    what an earlier run learned (`saved`, the store's attachments); `next_use` and `distance_counts` are
    what `FMoE.from_traces` fitted for the learned forecasts."""
    popularity = Popularity(
        options.popularity, saved.get("popularity"), ctx.num_layers, ctx.num_experts, ctx.top_k
    )
    if options.reuse_distance:
        forecast = DistanceForecast(
            ctx.num_layers,
            ctx.num_experts,
            ctx.top_k,
            distance_counts,
            horizon=reuse_horizon,
            sticky=options.sticky,
        )
    elif next_use is None:
        shape = (ctx.num_layers, ctx.num_experts)
        forecast = ReuseForecast(*shape, horizon=reuse_horizon, sticky=options.sticky)
    else:
        forecast = next_use.forecast(reuse_horizon)
    calibration.load(saved)
    next_calibration.load({k[len("next_") :]: v for k, v in saved.items() if k.startswith("next_")})
    forecast.load(saved)
    sorted_maps = SortedMaps()
    guides = Guides(
        ctx.num_layers,
        ctx.num_experts,
        ctx.top_k,
        dynamic_delta=options.dynamic_delta,
        calibrate=options.calibrate,
        calibration=calibration,
        next_calibration=next_calibration,
        forecast=forecast,
        sorted_maps=sorted_maps,
    )
    evictor = Eviction(
        options.eviction,
        cache,
        guides,
        forecast,
        popularity,
        lambda layer: admission.price(layer, guides.current),
        forecast if options.reuse_distance else None,
    )
    evictor.keeps_table = not options.asynchronous  # a matcher thread changes guides any time
    predicted = (
        None if reuse_predictor is None else PredictedReuse(reuse_predictor, ctx.num_layers, ctx.num_experts)
    )
    return Parts(popularity, forecast, sorted_maps, guides, evictor, predicted)


def attachments(
    calibration: Calibration, next_calibration: Calibration, forecast: Any, popularity: Popularity
) -> dict[str, np.ndarray]:
    """What a saved store keeps of the learned parts, for `build(saved=...)` in a later run."""
    out = {**calibration.state(), **forecast.state()}
    out |= {f"next_{k}": v for k, v in next_calibration.state().items()}
    if popularity.counts is not None:
        out["popularity"] = popularity.counts
    return out
