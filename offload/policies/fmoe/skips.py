"""Which of fMoE's trajectory searches are left out because the match they would make already holds:
after a layer whose routing the last match foresaw exactly (`skip_confirmed`), and after repeated matches
(`resting`). Most decode searches find the maps the one before found: the best of the stored prefixes
rarely changes as one more layer is summed. Decisions "skip confirmed searches" and "resting".
"""

from __future__ import annotations

import math

import numpy as np

from .options import FMoEOptions
from .select import SortedMaps

# A layer's routing confirms a match only where a stored map's top k would match it by chance less than
# once in 2 ** this many (log2 C(J, k)): the Qwen and DeepSeek presets, not Mixtral's 2 of 8 experts (4.8
# bits) or Phi-3.5's 2 of 16 (6.9). Decision "skip confirmed searches".
CONFIRMATION_BITS = 10


class SearchSkips:
    """The state the skipping rules keep across an iteration's searches. The matcher writes what a match
    foresaw and found (`foresee`, `repeats`); the engine thread reads it (`confirmed`, `resting`): a stale
    read only costs a search or skips one."""

    def __init__(self, options: FMoEOptions, num_experts: int, top_k: int, num_layers: int):
        self.band, self.resting_rule, self.num_layers = options.band, options.resting, num_layers
        self.confirming = (
            options.skip_confirmed
            and options.band
            and math.log2(math.comb(num_experts, top_k)) >= CONFIRMATION_BITS
        )
        self.top_k = top_k
        # (iteration, current, [B][L][k] nested lists): each row's matched map's top k per layer, in ascending
        # ids, foreseen after layer `current` (the layers up to it had routed)
        self._foreseen: tuple[int, int, list] | None = None
        self._matched: tuple[int, np.ndarray] | None = None  # (iteration, [B, L, J]): the last trajectory
        self._streak = 0  # trajectory matches in a row that found the same maps as the one before
        self._rest = (-1, -1)  # (iteration, layer): searches after layers up to it are left out

    def confirmed(
        self, layer: int, ids: np.ndarray, active: np.ndarray, iteration: int, decoding: bool
    ) -> bool:
        """Whether the iteration's last trajectory match foresaw this layer's routing: in decode, each active
        row's best map has the routed experts as its top k at `layer`."""
        foreseen = self._foreseen
        if not (self.confirming and decoding) or foreseen is None or foreseen[0] != iteration:
            return False
        _, current, tops = foreseen
        if len(tops) != len(active):
            return False
        if layer <= current:  # routed before the match: nothing foreseen there (no routing confirms it)
            return False
        if len(active) == 1:  # decode at batch 1: a Python sort of k ids (an array sort costs ~5x more)
            return sorted(np.asarray(ids)[active[0]].tolist()) == tops[0][layer]
        return np.sort(np.asarray(ids)[active], axis=1).tolist() == [top[layer] for top in tops]

    def foresee(self, iteration: int, maps: np.ndarray, current: int, sorted_maps: SortedMaps) -> None:
        """Records each row's matched map's top k at the layers after `current`, for `confirmed`."""
        tops = [sorted_maps.top_sets(expert_map, self.top_k) for expert_map in maps]  # [B][L][k]
        self._foreseen = (iteration, current, tops)

    def resting(self, layer: int, iteration: int) -> bool:
        """Whether the search after `layer` is left out because the searches before it found the same maps
        (`repeats`): with `resting="settle"`, every search after the iteration's first repeat; with
        "doubling", after n repeats in a row the next 2 ** (n - 1) layers' (their routing still counts: the
        next search sums it)."""
        rest = self._rest
        return rest[0] == iteration and layer <= rest[1]

    def repeats(self, context_iteration: int, iteration: int, layer: int, maps: np.ndarray) -> bool:
        """Whether a trajectory match of the current iteration (made after `layer`) found the same maps as
        the one before it (band targets: that one selected from them for every layer this one would guide).
        Counts the repeats in a row, for `resting`."""
        if not self.band or context_iteration != iteration:
            return False
        last, self._matched = self._matched, (context_iteration, maps)
        repeated = last is not None and last[0] == context_iteration and np.array_equal(last[1], maps)
        # An iteration's first search never repeats, so a streak never runs across iterations.
        self._streak = self._streak + 1 if repeated else 0
        if repeated:  # the match holds: the next searches would most likely find it again
            rest = 2 ** (self._streak - 1) if self.resting_rule == "doubling" else self.num_layers
            self._rest = (context_iteration, layer + rest)
        return repeated
