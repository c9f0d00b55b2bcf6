"""What one stop of the step program costs, measured live: the price the offload engine reports to its cache
(`CacheView.stop_s`) for a policy that weighs a miss's relaunch (fmoe's admission and credit).

A stop's cost is not one timed call: on a CPU backend a launch runs its program before it returns, and a
sync waits for the layers the launch ran. So, as `benchmarks/engine_costs.py` fits `launch_s`, it is the
slope of a line through decode steps' seconds against their stop counts (decision "relaunch price").
"""

from __future__ import annotations

import collections
import statistics

# Decode steps the line is fit through (the latest), and steps a stop count needs to give its median.
WINDOW, MIN_STEPS = 64, 3


class StopPrice:
    """The slope, in seconds per stop, of the median decode step at each stop count of the last `WINDOW`
    steps (counts with `MIN_STEPS` steps or more, two counts at least); 0 until then, and never below 0.

    A step's seconds are its wall time less the misses' own wait and the policy's event handlers (what
    the policy already prices, or what varies with its work rather than with the stops).
    """

    def __init__(self, window: int = WINDOW, min_steps: int = MIN_STEPS):
        self.steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.min_steps = min_steps
        self._seconds, self._stale = 0.0, False

    def add(self, stops: int, seconds: float) -> None:
        """One decode step's stops and seconds (the line is refit when next read: every decode step adds
        one, and only a policy that prices stops reads it)."""
        self.steps.append((stops, seconds))
        self._stale = True

    @property
    def seconds(self) -> float:
        return self.current()

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._seconds, self._stale = value, False

    def current(self) -> float:
        """The price now, refit if steps were added since the last fit (what `record_stop` is given)."""
        if self._stale:
            self._fit()
        return self._seconds

    def _fit(self) -> None:
        """Least squares in Python floats: a policy that prices stops reads the price at every decode step,
        and numpy's fit (`np.polyfit`, `np.median`) would cost it ~0.1 ms a step."""
        self._stale = False
        by_count: dict[int, list[float]] = collections.defaultdict(list)
        for count, s in self.steps:
            by_count[count].append(s)
        points = [(c, statistics.median(s)) for c, s in by_count.items() if len(s) >= self.min_steps]
        if len(points) >= 2:
            mean_x = sum(x for x, _ in points) / len(points)
            mean_y = sum(y for _, y in points) / len(points)
            sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
            sxx = sum((x - mean_x) ** 2 for x, _ in points)
            self._seconds = max(0.0, sxy / sxx)
