"""What fMoE's store learns from each iteration: its expert maps, and each map as a follower of the same
request's previous tokens' (`ExpertMapStore.add_future`), from which the reuse hint says what follows a map.
The matcher runs it on each update context; requests are told apart by their ids under continuous batching,
else by (the policy's request count, batch row).
"""

from __future__ import annotations

import collections

import numpy as np

from .matcher import Context
from .prefix_dots import PrefixDots
from .store import ExpertMapStore

# Requests whose last tokens are remembered for follower links; the least recently used go beyond it.
RECENT_REQUESTS = 1024


class FollowerLinks:
    """Each request's last `horizon` slots in the store."""

    def __init__(self, horizon: int):
        self.horizon = horizon
        self._recent: collections.OrderedDict[tuple, collections.deque] = collections.OrderedDict()

    def learn(self, store: ExpertMapStore, context: Context, prefix_dots: PrefixDots) -> None:
        """Adds an update context's maps to `store` and links each to its request's previous tokens."""
        # In decode the iteration's searches have summed most of these maps' dot products with the store's.
        dots = prefix_dots.full_dots(store, context.extra)
        slots = store.add(context.data, context.extra, dots)
        for slot, row, token_map in zip(slots, context.rows, context.extra, strict=True):
            key = (context.request, int(row)) if context.requests is None else (context.requests[row],)
            recent = self._recent.get(key)
            if recent is None:
                recent = self._recent[key] = collections.deque(maxlen=self.horizon)
                if len(self._recent) > RECENT_REQUESTS:
                    self._recent.popitem(last=False)
            self._recent.move_to_end(key)
            if recent:
                store.add_future(np.fromiter(recent, np.int64), token_map[None])  # one map, every slot
            recent.append(int(slot))
