"""DuoServe-MoE re-implemented in our runtime: prefill streams each layer's experts through the cache like
the paper's slot ring, decode prefetches the next layer's experts named by an offline-trained MLP
(`seeds/002_*`, sections 3-5).

The engine builds the policy from `OffloadConfig(policy=DuoServe(predictor=PATH))`; the predictor comes from
`benchmarks/train_predictors.py` (`offload/predictors.py`). Everything runs inline on the engine thread, so
the live engine and the trace-replay simulator see the same prefetch requests.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cache import CacheView, Entry, Key
from ..events import IterationStart, LayerRouted
from ..predictors import Predictor
from .base import PolicyContext
from .promoe import PredictedPrefetch


class DuoServe(PredictedPrefetch):
    """DuoServe-MoE: a prefill expert stream and a decode next-layer predictor.

    Source: DuoServe-MoE, section 5.2 (prefill) and sections 4 and 5.3 (decode predictor); `seeds/002_*`.

    Prefill (an iteration of more than one token per row), section 5.2. The paper keeps a GPU cache of k
    slots per layer and two CUDA streams: while one slot computes an expert, the other receives the next,
    and the stream runs on from one layer into the next. Our engine computes a layer in chunks of what the
    cache holds and loads misses on demand; the policy supplies the overlap:
      - at iteration start it streams layer 0's experts; after layer l routes, layer l + 1's experts (all J:
        prefill activates nearly every expert, and which ones is known only after the gate), in the order of
        their offline popularity (the order the ring would stream them);
      - a streamed expert may only take a slot the current layer no longer needs: experts of layers already
        computed go first (least recently used first, like a ring recycling its oldest slot), then this
        layer's experts once used; so in a layer that runs in chunks, the next layer's experts start as the
        last chunk's spare slots free up, and in a layer that fits they start at once.
    Decode, sections 4 and 5.3: layer 0 loads on demand after its gate ("the Expert Dispatcher fetches the
    expert models after the gate function completes the selection"); after each layer l routes, the State
    Constructor builds [experts chosen in layers 0..l, popularity of layer l + 1, affinity vector of layer
    l's choice] and the MLP predicts layer l + 1, whose per-token top-k experts are prefetched.

    Variant, where ours differs from the paper:
      - history h is a multi-hot `[L, J]` (zeros for layers not reached) instead of zero-padded expert
        indices: the same information, unambiguous (index 0 is an expert, not padding) and friendlier to an
        MLP; the affinity input is the mean of the affinity rows of the previous layer's chosen experts (the
        "affinity vector from the previous layer's expert selection" of section 5.3) rather than the whole
        flattened matrix, which is a constant per layer;
      - the MLP defaults to hidden widths (256, 128, 64) with ReLU and dropout 0.1, without BatchNorm (inputs
        are standardised instead; at inference BatchNorm is an affine map the layers absorb) instead of the
        paper's seven layers from 2048 down to 64, so that predicting on the host stays well under a
        millisecond; `benchmarks/train_predictors.py --duoserve-hidden 2048,1024,512,256,128,64` trains the
        paper's widths;
      - the cache budget is ours (`cache_experts`), not fixed at k; with more than k slots, experts of
        layers still to come stay ahead of those of computed layers, so later iterations may hit.
    `prefetch_distance` does not apply: DuoServe predicts the next layer only (section 4 argues against
    iterative prediction over several layers).

    Args:
      predictor: a `Predictor` of kind "duoserve", or its path (from `benchmarks/train_predictors.py`).
      prefetch_k: experts per token to prefetch in decode (default: the model's top-k).
      prefill_stream: stream experts during prefill (off: prefill loads on demand).
      decode_predictor: prefetch predicted experts in decode (off: decode loads on demand).
    """

    name = "duoserve"
    kind = "duoserve"

    def __init__(
        self,
        *,
        predictor: Predictor | str | os.PathLike,
        prefetch_k: int | None = None,
        prefill_stream: bool = True,
        decode_predictor: bool = True,
    ):
        super().__init__(predictor=predictor, prefetch_k=prefetch_k)
        self.prefill_stream = prefill_stream
        self.decode_predictor = decode_predictor
        self.prefill = False
        self.history = np.zeros((0, 0, 0), np.float32)  # [N, L, J] experts each decode row chose so far

    @classmethod
    def from_traces(
        cls, traces: Sequence[Any], *, prefetch_distance: int, store_capacity: int, **options: Any
    ) -> DuoServe:
        """DuoServe with its decode predictor trained on recorded traces; a `predictor` in `options` is
        used as it is."""
        if "predictor" not in options:
            from ..predictor_training import train_duoserve

            options["predictor"] = train_duoserve(traces, progress=False)
        return cls(**options)

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        self.predictor = self._load_predictor(ctx)
        # Stream order: each layer's experts by offline popularity, most popular first.
        self.stream_order = np.argsort(-self.predictor.popularity, axis=-1, kind="stable")  # [L, J]

    def _stream(self, layer: int) -> list[tuple[Key, float]]:
        """Every expert of `layer` in stream order, urgency falling from 1 to 1 / J."""
        j = self.ctx.num_experts
        items = [((layer, int(e)), (j - rank) / j) for rank, e in enumerate(self.stream_order[layer])]
        self.want.update(items)
        self.counts["streamed_layers"] += 1
        return items

    def on_iteration_start(self, event: IterationStart) -> None:
        valid = event.valid
        self._start_iteration(valid)
        self.prefill = valid.shape[1] > 1
        if not self.prefill:
            self.history = np.zeros((valid.size, self.ctx.num_layers, self.ctx.num_experts), np.float32)
        items = self._stream(0) if self.prefill and self.prefill_stream else []
        self.cache.request_prefetch(items, replace=True)

    def on_layer_routed(self, event: LayerRouted) -> None:
        self._routed(event)
        layer, ids = event.layer, event.ids
        target = layer + 1
        if self.prefill:
            if self.prefill_stream and target < self.ctx.num_layers:
                self.cache.request_prefetch(self._stream(target), replace=True)
            return
        np.put_along_axis(self.history[:, layer], ids.astype(np.int64), 1.0, axis=-1)
        if not self.decode_predictor or target >= self.ctx.num_layers:
            return
        probs = self._predict(self.predictor.duoserve_probs, self.history[self.rows], target)  # [n, J]
        self.cache.request_prefetch(self._select(target, probs, 1), replace=True)

    def on_iteration_end(self) -> None:
        self._end_iteration()

    def idle_keep(self, key: Key, entry: Entry) -> float:
        """Experts of layers still to come in this iteration (0.5) outlive those of computed layers (0)."""
        return 0.5 if key[0] > self.current else 0.0
