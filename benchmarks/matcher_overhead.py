"""Host cost of fMoE's expert map matcher: search latency, `add` on a full store, and store memory.

Run by hand: `python -m benchmarks.matcher_overhead [--out benchmarks/results/]`; writes a table to
stdout and `matcher_overhead.json` and `matcher_overhead.png` to --out.

Shapes are those of Mixtral-8x7B, Qwen1.5-MoE and Phi-3.5-MoE (L layers, J experts, H hidden size).
Synthetic contexts: stored and query iterations are drawn around 256 random "contexts" (embedding
and router logits), so every query has a cluster of near neighbours, as in real traces where the
same tokens and routes recur. Each search is timed at batch 1 (one decode iteration); the trajectory
search observes l = L/2 layers, warm (store in the CPU caches, where it fits) and cold (a 512 MiB
read before each call evicts it, as the engine's expert traffic would). Semantic search is timed
with the default sketch shortlist and exact (`sketch_dim=None`); `recall` is the share of queries
where both return the same map. BLAS threads follow the environment (OPENBLAS_NUM_THREADS), which
the JSON records: on a shared 2-core machine, two BLAS threads stall for whole 8 ms scheduler slices
whenever another process runs, so the committed results were taken with OPENBLAS_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from fmoe_jax.offload.cache import BookView, CacheBook
from fmoe_jax.offload.policies.fmoe import HINT_NEIGHBOURS
from fmoe_jax.offload.policies.fmoe.prefix_dots import PrefixDots
from fmoe_jax.offload.policies.fmoe.store import ExpertMapStore

from benchmarks.common import HelpFormatter, save_png

MODELS = {
    "Mixtral-8x7B": dict(num_layers=32, num_experts=8, embed_dim=4096),
    "Qwen1.5-MoE": dict(num_layers=24, num_experts=60, embed_dim=2048),
    "Phi-3.5-MoE": dict(num_layers=32, num_experts=16, embed_dim=4096),
    "Qwen3-30B-A3B": dict(num_layers=48, num_experts=128, embed_dim=2048),
    "OLMoE-1B-7B": dict(num_layers=16, num_experts=64, embed_dim=2048),
    "DeepSeek-V2-Lite": dict(num_layers=26, num_experts=64, embed_dim=2048),
    "gpt-oss-20b": dict(num_layers=24, num_experts=32, embed_dim=2880),
}
CAPACITIES = (1024, 4096, 16384, 32768)
POLICY_ROUNDS = 5  # `measure`'s rounds of `policy_iteration`
PREFETCH_DISTANCE = 3
NUM_CONTEXTS = 256
FILL_CHUNK = 4096
# `policy_iteration`'s iterations feed tokens in a cycle this long (fmoe's token contexts then hit).
TOKEN_CYCLE = 16
FLUSH_BYTES = 512 * 2**20
# Targets from the project brief, for Mixtral's shapes at batch 1.
TARGETS_MS = {1024: 1.0, 32768: 10.0}


class Contexts:
    """Iterations drawn around fixed random contexts: embeddings [H] and expert maps [L, J]."""

    def __init__(self, seed: int, num_layers: int, num_experts: int, embed_dim: int):
        rng = np.random.default_rng(seed)
        self.shape = (num_layers, num_experts)
        self.centres = rng.standard_normal((NUM_CONTEXTS, embed_dim), dtype=np.float32)  # [K, H]
        self.logits = 2.0 * rng.standard_normal((NUM_CONTEXTS, num_layers, num_experts), dtype=np.float32)

    def draw(self, rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray]:  # [B, H], [B, L, J]
        ids = rng.integers(NUM_CONTEXTS, size=rows)
        noise = rng.standard_normal((rows, self.centres.shape[1]), dtype=np.float32)
        embeds = self.centres[ids] + 0.3 * noise
        logits = self.logits[ids] + 0.5 * rng.standard_normal((rows, *self.shape), dtype=np.float32)
        maps = np.exp(logits - logits.max(-1, keepdims=True))
        return embeds, maps / maps.sum(-1, keepdims=True)


def _filled_store(contexts: Contexts, capacity: int, dims: dict, sketch_dim: int | None) -> ExpertMapStore:
    store = ExpertMapStore(
        capacity=capacity, prefetch_distance=PREFETCH_DISTANCE, sketch_dim=sketch_dim, **dims
    )
    rng = np.random.default_rng(1)
    for start in range(0, capacity, FILL_CHUNK):
        store.add(*contexts.draw(rng, min(FILL_CHUNK, capacity - start)))
    return store


def _time_ms(fn, args_list, flush: np.ndarray | None = None) -> np.ndarray:
    """Milliseconds per call; with `flush`, each call first reads it to push the store out of cache."""
    fn(*args_list[0])
    out = np.empty(len(args_list))
    for i, args in enumerate(args_list):
        if flush is not None:
            flush.sum()
        start = time.perf_counter()
        fn(*args)
        out[i] = (time.perf_counter() - start) * 1e3
    return out


def _stats(times_ms: np.ndarray) -> dict:
    return {"p50_ms": float(np.percentile(times_ms, 50)), "p90_ms": float(np.percentile(times_ms, 90))}


class _NullCache(BookView):
    """A `CacheView` with an empty cache that takes prefetch requests and carries none out: the policy's own
    host work is what is timed."""

    def __init__(self, capacity: int):
        self.book = CacheBook(capacity, expert_bytes=1)
        self.timers = {"on_demand_wait": 0.0}

    def request_prefetch(self, items, **kwargs) -> None:
        list(items)

    def drop_prefetches(self, *, before: int) -> None:
        pass


def policy_iteration(
    store: ExpertMapStore, queries: list, top_k: int, prefetch_distance: int, **options: Any
) -> dict:
    """The whole fmoe policy's host work per decode iteration (batch 1), as the matcher thread and the engine
    thread do it together: semantic search, the trajectory searches (less those `skip_confirmed` and resting
    leave out), selection and admission of the selected experts, the calibration and forecast updates, the map
    update (`learn`), the reuse hint and the token contexts (the i-th iteration feeds token i mod
    `TOKEN_CYCLE`, so that its contexts have been seen). Each query's map is the iteration's routing (its top
    k per layer).
    Besides the time: searches, layers confirmed (`skip_confirmed`) and layers rested (after repeated matches)
    per iteration.
    Every selected expert is admitted (no cost hints): the most prefetch requests a search can make.
    `options` go to `FMoE` (`semantic=False, trajectory=False`: the same iteration without searches)."""
    from fmoe_jax.offload.events import IterationStart, LayerRouted, needed_experts
    from fmoe_jax.offload.policies import FMoE, PolicyContext

    layers, experts = store.num_layers, store.num_experts
    ctx = PolicyContext(
        num_layers=layers,
        num_experts=experts,
        top_k=top_k,
        embed_dim=store.embed_dim,
        prefetch_distance=prefetch_distance,
        capacity=layers * experts // 4,
        matcher_s=0.0,  # every search and update is done (`pay_for_matching` leaves none out)
    )
    policy = FMoE(store=store, asynchronous=False, **options)
    policy.bind(ctx, _NullCache(ctx.capacity))
    valid = np.ones((1, 1), bool)

    def events(embeds: np.ndarray, maps: np.ndarray, token: int) -> tuple[IterationStart, list[LayerRouted]]:
        """The engine's events of one iteration: its routing (top k of the map) is the router's work, on
        the device, and the needed experts are computed for every policy, so both are made untimed."""
        routed = []
        for layer in range(layers):
            ids = np.argsort(-maps[:, layer], axis=-1, kind="stable")[:, :top_k]
            routed.append(
                LayerRouted(layer, ids, valid, needed_experts(ids, valid.reshape(-1)), maps[:, layer])
            )
        return IterationStart(valid, embeds, tokens=np.array([token])), routed

    matcher = []  # each iteration's milliseconds in the matcher's own work (`FMoE.timers`)

    def iteration(start: IterationStart, routed: list[LayerRouted]) -> None:
        before = policy.timers["matching"] + policy.timers["store_update"]
        policy.on_iteration_start(start)
        for event in routed:
            policy.on_layer_routed(event)
        policy.on_iteration_end()
        matcher.append(1e3 * (policy.timers["matching"] + policy.timers["store_update"] - before))

    times = _time_ms(iteration, [events(*query, i % TOKEN_CYCLE) for i, query in enumerate(queries)])
    counts = policy.stats()
    iterations = len(queries) + 1  # `_time_ms` runs the first once more, untimed
    return {
        "policy_iteration": _stats(times),
        "policy_iteration_times_ms": times,  # each iteration's, for `measure`'s rounds
        # The part of each that the matcher thread does live: searches, selection, the map update and the
        # reuse hint (the rest is the engine thread's: per-layer bookkeeping, the forecast, the guess).
        "matcher_thread_times_ms": np.array(matcher[1:]),  # `_time_ms`'s untimed first call left out
        "searches_per_iteration": counts.get("trajectory_matches", 0) / iterations,
        "skipped_per_iteration": counts.get("confirmed_layers", 0) / iterations,
        "rested_per_iteration": counts.get("rested_layers", 0) / iterations,  # after repeated matches
    }


def partial_searches(store: ExpertMapStore):
    """A function running one iteration's trajectory searches of a map `[1, L, J]`: `searches` of them, on
    prefixes of 1, 2, ... layers, with one running `PrefixDots`."""

    def run(maps: np.ndarray, searches: int) -> None:
        running = PrefixDots()
        for observed in range(1, searches + 1):
            store.match_traj(maps[:, :observed], running)

    return run


def policy_rounds(
    store: ExpertMapStore,
    contexts: Contexts,
    repeats: int,
    top_k: int,
    prefetch_distance: int,
    rounds: int = POLICY_ROUNDS,
) -> dict:
    """`policy_iteration` over `repeats` iterations, and the same with no searches (the engine thread's
    bookkeeping, the reuse forecast, the map update and the hint, which no faster search removes), taking
    turns for `rounds` rounds: this VM's speed drifts by tens of per cent within minutes, and one burst of
    iterations falls wherever it falls. The medians pool every round's iterations; each round's median is
    kept to show the spread.

    Every run starts from a copy of `store` and each round draws tokens of its own: the policy adds every
    iteration's map to its store, so tokens replayed on the store that learned them would match themselves
    (searches per iteration fell from 8.2 to 1-3 at Qwen1.5-MoE's shapes) and time an easier iteration than
    a new token's. `store` itself is left as it was."""
    full, bare, searches, matcher = [], [], [], []
    for index in range(rounds):
        rng = np.random.default_rng(1000 + index)  # the same tokens for both runs of a round
        queries = [contexts.draw(rng, 1) for _ in range(repeats)]
        counts = policy_iteration(copy.deepcopy(store), queries, top_k, prefetch_distance)
        full.append(counts.pop("policy_iteration_times_ms"))
        matcher.append(counts.pop("matcher_thread_times_ms"))
        searches.append(counts["searches_per_iteration"])
        bare.append(
            policy_iteration(
                copy.deepcopy(store), queries, top_k, prefetch_distance, semantic=False, trajectory=False
            )["policy_iteration_times_ms"]
        )
    return counts | {  # the search counts: the last round's, and each round's searches
        "searches_by_round": searches,
        "policy_iteration": _stats(np.concatenate(full)),
        "policy_iteration_rounds_ms": [float(np.median(t)) for t in full],
        "matcher_thread": _stats(np.concatenate(matcher)),
        "policy_iteration_no_search": _stats(np.concatenate(bare)),
    }


def measure(
    name: str,
    dims: dict,
    capacity: int,
    repeats: int,
    flush: np.ndarray,
    prefetch_distance: int = PREFETCH_DISTANCE,
    top_k: int | None = None,
) -> dict:
    """Times the store's searches and updates at `dims`; with `top_k` (the model's experts per token), also
    the whole fmoe policy's decode iteration (`policy_iteration`)."""
    contexts = Contexts(seed=0, **dims)
    rng = np.random.default_rng(2)
    queries = [contexts.draw(rng, 1) for _ in range(repeats)]
    observed = dims["num_layers"] // 2
    row = {"model": name, **dims, "capacity": capacity}

    results = {}
    for mode, sketch_dim in (("exact", None), ("sketch", 256)):
        store = _filled_store(contexts, capacity, dims, sketch_dim)
        row[f"nbytes_{mode}"] = store.nbytes
        sem_args = [(e,) for e, _ in queries]
        row[f"sem_{mode}"] = _stats(_time_ms(store.match_embed, sem_args))
        row[f"sem_{mode}_cold"] = _stats(_time_ms(store.match_embed, sem_args[: repeats // 2], flush))
        results[mode] = [store.match_embed(e) for e, _ in queries]
        if mode == "sketch":
            traj_args = [(m[:, :observed],) for _, m in queries]
            row["traj"] = _stats(_time_ms(store.match_traj, traj_args))
            row["traj_cold"] = _stats(_time_ms(store.match_traj, traj_args[: repeats // 2], flush))
            # One decode iteration's searches as fmoe runs them: after each layer l < L - d, layers 0..l,
            # summed layer by layer (`PrefixDots`), in milliseconds per iteration.
            searches = dims["num_layers"] - prefetch_distance
            iteration_args = [(m, searches) for _, m in queries]
            row["traj_iteration"] = _stats(_time_ms(partial_searches(store), iteration_args))
            row["add_full_b1"] = _stats(_time_ms(store.add, [contexts.draw(rng, 1) for _ in range(repeats)]))
            batches = [contexts.draw(rng, 64) for _ in range(max(3, repeats // 20))]
            row["add_full_b64"] = _stats(_time_ms(store.add, batches))
            # fmoe's reuse hint after each iteration: what followed the stored map most like the last token's
            # (`future_of`, one more pass over the store's maps), once every stored map has a follower.
            slots = np.arange(len(store))
            for start in range(0, len(slots), FILL_CHUNK):
                part = slots[start : start + FILL_CHUNK]
                store.add_future(part, contexts.draw(rng, len(part))[1])
            hint_args = [(m, HINT_NEIGHBOURS) for _, m in queries]
            row["future_of_b1"] = _stats(_time_ms(store.future_of, hint_args))
            if top_k is not None:
                row |= policy_rounds(store, contexts, repeats, top_k, prefetch_distance)
        del store

    same = [np.array_equal(s[1], e[1]) for s, e in zip(results["sketch"], results["exact"], strict=True)]
    gaps = [float(e[0][0] - s[0][0]) for s, e in zip(results["sketch"], results["exact"], strict=True)]
    row["sketch_recall"] = float(np.mean(same))
    # Queries with a related stored context; the rest have only unrelated maps (cosine ~0) to choose from.
    related = [e[0][0] >= 0.5 for e in results["exact"]]
    row["sketch_recall_related"] = float(np.mean(np.array(same)[related])) if any(related) else None
    row["sketch_score_gap_max"] = max(gaps)
    return row


def print_table(rows: list[dict]) -> None:
    columns = [
        ("sem sketch", "sem_sketch"),
        ("sem sketch cold", "sem_sketch_cold"),
        ("sem exact", "sem_exact"),
        ("sem exact cold", "sem_exact_cold"),
        ("traj l=L/2", "traj"),
        ("traj cold", "traj_cold"),
        ("add B=1", "add_full_b1"),
        ("add B=64", "add_full_b64"),
        ("future_of B=1", "future_of_b1"),
    ]
    head = f"{'model':<13} {'C':>6} {'MiB':>5} " + " ".join(f"{title:>15}" for title, _ in columns)
    head += f" {'recall':>6} {'rel.':>5} {'gap':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = " ".join(f"{r[key]['p50_ms']:>7.3f}/{r[key]['p90_ms']:<7.3f}" for _, key in columns)
        related = r["sketch_recall_related"]
        print(
            f"{r['model']:<13} {r['capacity']:>6} {r['nbytes_sketch'] / 2**20:5.0f} {cells} "
            f"{r['sketch_recall']:6.2f} {float('nan') if related is None else related:5.2f} "
            f"{r['sketch_score_gap_max']:7.4f}"
        )
    print(
        "p50/p90 ms, batch 1 unless noted; cold: store pushed out of the CPU caches before each call; "
        "MiB: store arrays with the sketch;\nrecall: sketch search returns the exact best map "
        "(rel.: among queries with exact score >= 0.5); gap: max exact-minus-sketch score"
    )


def plot(payload: dict, path: Path) -> None:
    """The figure from the saved results (host NumPy timings: live, on the machine that ran them)."""
    rows = payload["rows"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name in MODELS:
        rs = [r for r in rows if r["model"] == name]
        if not rs:
            continue
        caps = [r["capacity"] for r in rs]

        def p50(key, rs=rs):
            return [r[key]["p50_ms"] for r in rs]

        (line,) = axes[0].plot(caps, p50("sem_sketch_cold"), "o-", label=f"{name} sketch, cold")
        color = line.get_color()
        axes[0].plot(caps, p50("sem_sketch"), "o:", color=color, label=f"{name} sketch, warm")
        axes[0].plot(caps, p50("sem_exact_cold"), "s--", color=color, label=f"{name} exact, cold")
        axes[1].plot(caps, p50("traj_cold"), "o-", color=color, label=f"{name} cold")
        axes[1].plot(caps, p50("traj"), "o:", color=color, label=f"{name} warm")
        axes[2].plot(caps, p50("add_full_b1"), "o-", color=color, label=name)
    for cap, target in TARGETS_MS.items():
        for ax in axes[:2]:
            ax.plot([cap], [target], "kx", markersize=10)
    titles = ("semantic match, batch 1", "trajectory match, batch 1, l = L/2", "add on a full store, batch 1")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("store capacity C")
        ax.set_ylabel("p50 latency (ms)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("live (host CPU): fMoE expert map matcher (x: the brief's targets for Mixtral)")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results",
        help="directory for the JSON, PNG and markdown results",
    )
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per measurement")
    parser.add_argument(
        "--capacities",
        type=int,
        nargs="+",
        default=list(CAPACITIES),
        help="store capacities (expert maps) swept",
    )
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="models to run"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # Larger than the last-level cache (105 MiB on the development machine).
    flush = np.ones((FLUSH_BYTES // 4,), np.float32)
    rows = []
    for name in args.models:
        for capacity in args.capacities:
            rows.append(measure(name, MODELS[name], capacity, args.repeats, flush))
    print_table(rows)

    mixtral = {r["capacity"]: r for r in rows if r["model"] == "Mixtral-8x7B"}
    checks = {
        f"{kind} C={cap} p50 <= {target} ms": mixtral[cap][kind]["p50_ms"] <= target
        for cap, target in TARGETS_MS.items()
        if cap in mixtral
        for kind in ("sem_sketch", "sem_sketch_cold", "sem_exact", "sem_exact_cold", "traj", "traj_cold")
    }
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  Mixtral {check}")

    env = {"numpy": np.__version__, "cpu_count": os.cpu_count(), "machine": platform.machine()}
    env.update({var: os.environ.get(var) for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")})
    payload = {"env": env, "prefetch_distance": PREFETCH_DISTANCE, "repeats": args.repeats, "rows": rows}
    payload["mixtral_targets"] = checks
    (args.out / "matcher_overhead.json").write_text(json.dumps(payload, indent=2))
    plot(payload, args.out / "matcher_overhead.png")
    print(f"wrote {args.out / 'matcher_overhead.json'} and {args.out / 'matcher_overhead.png'}")


if __name__ == "__main__":
    main()
