"""The shared harness of the paper-figure experiments (`benchmarks/exp*.py`): workloads, fair policy setups,
live and simulated runs, and the result files (JSON, PNG, markdown) each experiment writes.

A `Workload` is a model plus prompts split 7:3 into a store set and an evaluation set (disjoint, by uid hash:
`workloads.split_store_eval`), token ids cut to `--prompt-tokens`, and the routing trace of every request
recorded once (batch 1, greedy, `--new-tokens` tokens, no EOS stop; cached on disk). Policies learn only from
the store set: fmoe's expert-map store (`store_from_traces`) and reuse predictor, MoE-Infinity's activation-
matrix collection (`eamc_from_traces`), ProMoE's and DuoServe's predictors (trained on the store traces); the
oracle gets the recorded routing of the very calls it serves. Live runs serve the evaluation prompts on
whatever JAX backend is present, after `--warmup` store prompts that compile and warm the cache; simulated
runs replay the same traces after the same warm-up through `fmoe_jax.offload.simulator` at a real model's
sizes on a hardware preset. `--split validation` splits the store set 7:3 again and replays its 30 % in place
of the evaluation set: designs are tried there, and the evaluation prompts only report.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (  # noqa: F401 (experiments use h.colours, h.mode_title, h.saved, ...)
    HARDWARE_NAMES,
    RESULTS,
    colours,
    grouped_bars,
    machine,
    mode_title,
    print_table,
    save,
    saved,
    scrub_paths,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
CACHE = Path(os.environ.get("FMOE_BENCH_CACHE", Path.home() / ".cache" / "fmoe-jax-benchmarks"))
# The paper's comparison (figure 9): fMoE, MoE-Infinity, ProMoE, Mixtral-Offloading, DeepSpeed-Inference
# (on-demand with an LRU cache); plus LFU on demand, DuoServe-MoE and the oracle upper bound.
POLICIES = (
    "on_demand_lru",
    "on_demand_lfu",
    "mixtral_offload",
    "moe_infinity",
    "promoe",
    "duoserve",
    "fmoe",
    "oracle",
)
# Simulated-only workloads experiments 2 and 4 add to the shipped models: a shipped model's traces replayed at
# the sizes of a model no shipped model has the architecture of (NAME@PRESET, see `--model`).
PRESET_REPLAYS = ("fmoe-tiny-qwen3-moe@qwen3_next",)
PROMPT_LOADERS = {"sharegpt": "load_sharegpt", "mt_bench": "load_mt_bench", "alpaca_eval": "load_alpaca_eval"}


# ---------------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """The options every experiment shares; `defaults` overrides the experiment's quick defaults."""
    from fmoe_jax.offload.cost_model import HARDWARE
    from fmoe_jax.offload.policies.fmoe import STORE_CAPACITY

    d = (
        dict(
            model=default_models(),
            prompts="domains",
            n_prompts=120,
            prompt_tokens=32,
            new_tokens=32,
            budget=0.25,
            prefetch_distance=3,
            store_capacity=STORE_CAPACITY,
            eam_capacity=1000,  # MoE-Infinity's own default
            warmup=2,
            max_inflight=4,
            live_requests=18,
            hardware=["rtx_3090", "h100_sxm"],
        )
        | defaults
    )
    a = parser.add_argument
    a(
        "--model",
        nargs="+",
        default=d["model"],
        help="shipped model names or checkpoint directories; NAME@PRESET replays NAME's traces at the sizes "
        "of cost_model.MODELS[PRESET] (simulated only: e.g. fmoe-tiny-qwen3-moe@qwen3_next); "
        "gpt-oss-20b-routing[@EXPERTS]: gpt-oss-20b's real routing (benchmarks/real_routing.py)",
    )
    a("--data", type=Path, default=DATA, help="data directory (corpora/, prompts/, arrivals/)")
    a(
        "--prompts",
        default=d["prompts"],
        help="'domains' (held-out text of the six training corpora) or a ShareGPT/MT-Bench/AlpacaEval file",
    )
    a("--n-prompts", type=int, default=d["n_prompts"], help="prompts in all, split 7:3 into store / eval")
    a("--prompt-tokens", type=int, default=d["prompt_tokens"], help="prompt ids cut to this many tokens")
    a("--new-tokens", type=int, default=d["new_tokens"], help="tokens generated per request")
    a("--budget", type=float, default=d["budget"], help="expert cache, fraction of all routed experts")
    a("--prefetch-distance", type=int, default=d["prefetch_distance"], help="d (the paper's setting: 3)")
    a("--store-capacity", type=int, default=d["store_capacity"], help="expert maps fmoe's store keeps")
    a("--eam-capacity", type=int, default=d["eam_capacity"], help="MoE-Infinity's EAMs per phase")
    a("--max-inflight", type=int, default=d["max_inflight"], help="prefetch copies in flight at once")
    a("--warmup", type=int, default=d["warmup"], help="store prompts served first, not measured")
    a("--live-requests", type=int, default=d["live_requests"], help="eval prompts served live (first ones)")
    a(
        "--hardware",
        nargs="+",
        default=d["hardware"],
        choices=list(HARDWARE),
        help="simulator hardware presets",
    )
    a(
        "--sim-model",
        default="preset",
        choices=["preset", "own"],
        help="sizes the simulator charges: the real model of the family (preset) or the checkpoint's own",
    )
    a("--no-live", action="store_true", help="skip the live runs")
    a("--no-sim", action="store_true", help="skip the simulated runs")
    a(
        "--record-budget",
        type=float,
        default=1.0,
        help="cache while recording traces: 1 = every expert on the device; lower for models that do not fit",
    )
    a("--seed", type=int, default=0, help="store/eval split and arrival assignment")
    a(
        "--split",
        default="eval",
        choices=SPLITS,
        help="'eval': replay the evaluation prompts (what results report); 'validation': split the store "
        "prompts 7:3 again and replay their 30 %%, for designing and tuning without seeing an evaluation "
        "prompt",
    )
    a("--out", type=Path, default=RESULTS)
    a("--cache-dir", type=Path, default=CACHE, help="recorded traces and trained predictors")
    a(
        "--routing-requests",
        type=int,
        default=d.get("routing_requests", 40),
        help="--model gpt-oss-20b-routing[@EXPERTS]: requests of its evaluation (or validation) part "
        "replayed, evenly spaced (benchmarks/real_routing.py)",
    )
    a("--routing-data", type=Path, default=None, help="that routing set (default: the shared one)")


def add_merge_argument(parser: argparse.ArgumentParser) -> None:
    """`--merge`: run some models only, keeping the saved results' other models (`write_results`)."""
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add the --model results to the saved ones (others kept; the saved command stays the one to "
        "rerun)",
    )


SPLITS = ("eval", "validation")


def split_prompts(prompts: Sequence[Any], split: str, seed: int) -> tuple[list, list]:
    """(store, replayed) prompts. "eval": the 7:3 store / evaluation split. "validation": the same store
    prompts split 7:3 again, so a design tried on the validation split never sees an evaluation prompt."""
    from fmoe_jax.research import workloads

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    store, evaluation = workloads.split_store_eval(prompts, 0.7, seed=seed)
    if split == "validation":
        store, evaluation = workloads.split_store_eval(store, 0.7, seed=seed)
    return store, evaluation


def default_models() -> list[str]:
    import fmoe_jax as fj

    shipped = fj.shipped_models()
    return shipped or ["random-tiny-mixtral"]


def command_line() -> str:
    module = Path(sys.argv[0]).stem
    return shlex.join([".venv/bin/python", "-m", f"benchmarks.{module}", *sys.argv[1:]])


# ---------------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    prompt: Any  # workloads.Prompt
    ids: list[int]
    trace: Any  # RoutingTrace of this request alone (batch 1)


@dataclasses.dataclass
class Workload:
    name: str
    model: Any  # fj.Model, experts in pinned host memory (serves every policy's engine)
    store: list[Request]
    eval: list[Request]
    preset: Any  # ModelPreset the simulator charges
    router_weights: tuple[np.ndarray, ...]
    args: argparse.Namespace
    cache_dir: Path
    simulated_only: bool = False  # NAME@PRESET: another model's sizes, so no live run stands for it
    # Routing recorded elsewhere (`real_routing`): no model, and its own part of its own split replayed.
    part: str = ""
    learned: dict[tuple, Any] = dataclasses.field(default_factory=dict)  # policies built from the store

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def recorded(self) -> bool:
        """Whether the traces are this project's recordings of the model (embeddings and router inputs
        included); routing recorded elsewhere has the experts chosen and their weights only."""
        return self.model is not None

    @property
    def total_experts(self) -> int:
        if self.recorded:
            return self.config.num_moe_layers * self.config.num_experts
        meta = (self.store or self.eval)[0].trace.meta
        return meta["num_layers"] * meta["num_experts"]

    def close(self) -> None:
        if self.model is not None:
            self.model.close()

    def slots(self, budget: float) -> int:
        return max(1, round(budget * self.total_experts))

    @property
    def trace_layers(self) -> int:
        """MoE layers in the workload's traces (the simulator replays these, not the preset's count)."""
        if self.recorded:
            return self.config.num_moe_layers
        return (self.store or self.eval)[0].trace.meta["num_layers"]

    def sizes(self, preset: Any = None) -> str:
        """What "simulated at ..." says for this workload at `preset` (default its own): `sizes_phrase`."""
        return sizes_phrase(preset or self.preset, self.trace_layers)


def sizes_phrase(preset: Any, trace_layers: int) -> str:
    """How a caption names the sizes a replay was charged at: "gpt-oss-20b sizes" when the traces have all
    of the preset's MoE layers; "Mixtral-8x7B's per-layer sizes (8 of its 32 MoE layers)" when the replay
    covers only the traces' layers, so that no reader takes it for the whole model (`offload/projection.py`
    projects a trace onto all of them; the experiments here replay the traces as recorded)."""
    if trace_layers == preset.num_layers:
        return f"{preset.name} sizes"
    return f"{preset.name}'s per-layer sizes ({trace_layers} of its {preset.num_layers} MoE layers)"


def resolve_model(name: str, cache_dir: Path) -> Path:
    """A directory `load_model` reads; `random-tiny-mixtral` is a random checkpoint for development."""
    if name == "random-tiny-mixtral":
        from fmoe_jax.testing import PRESETS, write_random_checkpoint

        path = cache_dir / "random-tiny-mixtral"
        if not (path / "config.json").exists():
            write_random_checkpoint(path, PRESETS["tiny-mixtral"])
        return path
    from fmoe_jax.loading import resolve

    return resolve(name)


def load_prompts(args: argparse.Namespace) -> list:
    from fmoe_jax.research import workloads

    if args.prompts == "domains":
        per_domain = -(-args.n_prompts // len(workloads.CORPUS_DOMAINS))
        return workloads.domain_prompts(args.data / "corpora", per_domain, seed=args.seed)
    path = Path(args.prompts)
    kind = next((k for k in PROMPT_LOADERS if k in path.name.lower()), None)
    if kind is None:
        raise SystemExit(f"--prompts {path}: name it after one of {sorted(PROMPT_LOADERS)} or use 'domains'")
    return getattr(workloads, PROMPT_LOADERS[kind])(path)[: args.n_prompts]  # file order


def encode(model: Any, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    from benchmarks.train_predictors import encode as encode_texts

    return encode_texts(model, list(texts), max_tokens)


def load_workload(name: str, args: argparse.Namespace, *, record: bool = True) -> Workload:
    """The model, the store/eval split and (with `record`) every request's routing trace."""
    from fmoe_jax.models import model_identity
    from fmoe_jax.offload.cost_model import MODELS, ModelPreset

    import fmoe_jax as fj
    from benchmarks import real_routing
    from fmoe_jax.engines.offload import router_weights

    if real_routing.is_routing(name):
        return real_routing.workload(name, args)
    base, _, preset_name = name.partition("@")
    if preset_name and preset_name not in MODELS:
        known = ", ".join(MODELS)
        raise SystemExit(f"--model {name}: no preset {preset_name!r} (cost_model.MODELS: {known})")
    path = resolve_model(base, args.cache_dir)
    # Experts go to pinned host memory; each run builds its own engine (`serving`) over these weights.
    model = fj.load_model(path, offload=fj.OffloadConfig(policy="on_demand_lru", cache_experts=1))
    cfg = model.config
    prompts = load_prompts(args)
    store, evaluation = split_prompts(prompts, getattr(args, "split", "eval"), args.seed)
    ids = encode(model, [p.text for p in store + evaluation], args.prompt_tokens)
    key = dict(
        model=model_identity(cfg),
        weights=_file_digest(path),
        code=_numerics_digest(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),  # rounding (fmoe_jax sets excess precision off)
        uids=[p.uid for p in store + evaluation],
        ids=ids,
        new_tokens=args.new_tokens,
        recorded="tokens",  # traces recorded with the fed token ids (fmoe's token contexts read them)
    )
    cache_dir = args.cache_dir / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    requests = [Request(p, i, None) for p, i in zip(store + evaluation, ids, strict=True)]
    if preset_name:
        preset = MODELS[preset_name]
    elif args.sim_model == "own" or cfg.family not in MODELS:
        preset = ModelPreset.from_config(cfg, name=Path(base).name)
    else:
        preset = MODELS[cfg.family]
    w = Workload(
        name=Path(base).name + (f"@{preset_name}" if preset_name else ""),
        model=model,
        store=requests[: len(store)],
        eval=requests[len(store) :],
        preset=preset,
        router_weights=router_weights(model.module),
        args=args,
        cache_dir=cache_dir,
        simulated_only=bool(preset_name),
    )
    if record:
        for request, trace in zip(requests, record_traces(w, ids, cache_dir / "traces"), strict=True):
            request.trace = trace
    return w


def _file_digest(path: Path) -> str:
    """Identifies a checkpoint's weights by file names, sizes and modification times (cheap, not a hash)."""
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    return hashlib.sha256(
        json.dumps(
            [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        ).encode()
    ).hexdigest()[:16]


def _numerics_digest() -> str:
    """Identifies the model code (`fmoe_jax.models`): a kernel change can flip near-tied routing choices,
    and the oracle must replay exactly the routing the live engine computes."""
    import fmoe_jax.models

    files = sorted(Path(fmoe_jax.models.__file__).parent.glob("*.py"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]


def record_traces(w: Workload, ids: list[list[int]], directory: Path) -> list:
    """Each request's routing (router inputs included), served alone; cached. Routing does not depend on
    the policy (offloading is lossless), so a model too large for the device records with a partial cache."""
    import fmoe_jax as fj

    stem = directory / "requests"
    if not stem.with_suffix(".json").exists():
        start, requests = time.perf_counter(), []
        budget = w.args.record_budget
        policy = "resident" if budget >= 1 else "on_demand_lru"
        with serving(w, fj.OffloadConfig(policy=policy, cache_experts=w.slots(min(budget, 1.0)))) as model:
            for n, prompt in enumerate(ids, start=1):
                out = fj.generate(
                    model,
                    [prompt],
                    w.args.new_tokens,
                    stop_at_eos=False,
                    record_trace=True,
                    record_hidden=True,
                )
                requests += out.trace.requests
                if n % 10 == 0 or n == len(ids):
                    print(
                        f"  recorded {n}/{len(ids)} requests ({time.perf_counter() - start:.0f} s)",
                        flush=True,
                    )
        directory.mkdir(parents=True, exist_ok=True)
        fj.RoutingTrace(out.trace.meta, requests).save(stem)
    whole = fj.RoutingTrace.load(stem)
    return [fj.RoutingTrace(whole.meta, [r]) for r in whole.requests]


def batch_trace(requests: Sequence[Request]) -> Any:
    """The routing of requests served together in one batch (each row's routing is its own)."""
    import fmoe_jax as fj

    return fj.RoutingTrace(requests[0].trace.meta, [r.trace.requests[0] for r in requests])


def batches(requests: Sequence[Request], size: int) -> list[list[Request]]:
    return [list(requests[i : i + size]) for i in range(0, len(requests), size)]


# ---------------------------------------------------------------------------------------------------------
# Policies, set up fairly
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """A policy as one row of a table: `options` are extra policy options (ablation switches); `knowledge`
    False starts learned policies empty (online serving: fmoe's store, MoE-Infinity's EAMs); `execution`
    "hybrid" lets the host compute misses (`OffloadConfig.execution`); `chunks`, the pieces a copy goes
    over the link in: None, each runtime's default (live: one `device_put` per expert; simulated: the cost
    model's choice, `HardwarePreset.copy_chunks`: 3, one per matrix, on the RTX 3090 preset, whole on the
    Hopper presets, whose copies pay a fixed cost each), 1 whole experts (both), 3 per matrix (live:
    `OffloadConfig(transfer="chunked")`)."""

    label: str
    policy: str
    options: tuple[tuple[str, Any], ...] = ()
    knowledge: bool = True
    execution: str = "copy"
    chunks: int | None = None
    finish_started: bool = True  # simulated: False cancels a prefetch between chunks (`SimulatedLink`)


def variants(names: Sequence[str]) -> list[Variant]:
    return [Variant(n, n) for n in names]


def runnable(workload: Workload, chosen: Sequence[Variant]) -> list[Variant]:
    """The variants a workload's traces can drive: all of them on this project's recordings; on routing
    recorded elsewhere (no router inputs) mixtral_offload without its speculative gate, and neither ProMoE
    nor DuoServe (their predictors read router inputs), nor a row that is about speculation."""
    from benchmarks import real_routing

    if workload.recorded:
        return list(chosen)
    out = []
    for v in chosen:
        if v.policy in ("promoe", "duoserve"):
            continue
        if v.policy == "mixtral_offload":
            if v.label != v.policy or dict(v.options).get("speculate", True) is False:
                continue  # a row about its speculation
            label, options = real_routing.WITHOUT_HIDDEN[v.policy]
            v = dataclasses.replace(v, label=label, options=options)
        out.append(v)
    return out


def predictor(workload: Workload, kind: str, stride: int, horizon: int = 2) -> Any:
    """ProMoE's (per stride), DuoServe's or fmoe's reuse predictor (per horizon), trained on the store traces
    only; cached on disk."""
    from fmoe_jax.models import model_identity
    from fmoe_jax.offload import predictors
    from fmoe_jax.research import predictor_training

    name = {"promoe": f"promoe-d{stride}", "duoserve": "duoserve", "reuse": f"reuse-h{horizon}"}[kind]
    path = workload.cache_dir / name
    if path.with_suffix(".json").exists():
        return predictors.Predictor.load(path)
    traces = [r.trace for r in workload.store]
    common = dict(model_id=model_identity(workload.config), progress=False)
    print(f"  training the {kind} predictor on {len(traces)} store requests", flush=True)
    if kind == "promoe":
        trained = predictor_training.train_promoe(traces, stride=stride, **common)
    elif kind == "reuse":
        trained = predictor_training.train_reuse(traces, horizon=horizon, **common)
    else:
        trained = predictor_training.train_duoserve(traces, **common)
    trained.save(path)
    return trained


def offload_config(
    workload: Workload,
    variant: Variant,
    *,
    calls: Sequence[Sequence[Request]],
    simulated: bool,
    budget: float | None = None,
    prefetch_distance: int | None = None,
    store_capacity: int | None = None,
    synchronous: bool = False,
) -> Any:
    """The `OffloadConfig` of one run; `calls` are the batches it will serve in order (the oracle's
    future). Learned state comes from the store split (`Policy.from_traces`; none without `knowledge`);
    the simulator needs fmoe to match inline."""
    from fmoe_jax.offload.policies import POLICIES as ALL_POLICIES
    from fmoe_jax.offload.policies.fmoe import auto_reuse_horizon

    import fmoe_jax as fj

    args = workload.args
    d = prefetch_distance or args.prefetch_distance
    # fmoe's store (`store_capacity` overrides it) and MoE-Infinity's EAM collection are sized apart, so
    # that a change of fmoe's store leaves the baseline as it was; no other policy keeps maps.
    capacity = store_capacity or args.store_capacity
    if variant.policy == "moe_infinity":
        capacity = args.eam_capacity
    options: dict[str, Any] = dict(variant.options)
    if variant.policy == "fmoe" and not workload.recorded:  # routing alone: no embeddings, no router inputs
        options.setdefault("semantic", False)
        options.setdefault("asynchronous", not simulated)
    elif variant.policy == "fmoe":
        options.setdefault("asynchronous", not simulated)
        if options.get("eviction", "reuse") == "reuse":  # its reuse forecast reads the router inputs
            # trained for the iterations the forecast looks ahead (`FMoE._train_reuse`)
            horizon = options.get("reuse_horizon", "auto")
            if horizon == "auto":
                slots = workload.slots(budget if budget is not None else args.budget)
                meta = workload.store[0].trace.meta
                horizon = auto_reuse_horizon(slots, meta["num_layers"], meta["top_k"])
            options.setdefault("reuse_predictor", predictor(workload, "reuse", d, horizon))
    elif variant.policy in ("promoe", "duoserve"):
        options["predictor"] = predictor(workload, variant.policy, d)  # trained once, cached on disk
    elif variant.policy == "oracle":
        options["traces"] = [batch_trace(c) for c in calls]
    store = [r.trace for r in workload.store] if variant.knowledge else []
    if variant.policy == "oracle":  # it knows the calls it serves and learns nothing from other requests
        policy = ALL_POLICIES["oracle"](**options)
    elif workload.recorded or not simulated:
        policy = ALL_POLICIES[variant.policy].from_traces(
            store, prefetch_distance=d, store_capacity=capacity, **options
        )
    else:  # routing recorded elsewhere: a large store, learned once per setting, a fresh copy each run
        key = (variant.policy, variant.knowledge, d, capacity, tuple(sorted(options.items(), key=str)))
        if key not in workload.learned:
            workload.learned[key] = ALL_POLICIES[variant.policy].from_traces(
                store, prefetch_distance=d, store_capacity=capacity, **options
            )
        policy = copy.deepcopy(workload.learned[key])
    return fj.OffloadConfig(
        policy=policy,
        cache_experts=workload.slots(budget if budget is not None else args.budget),
        prefetch_distance=d,
        max_inflight=args.max_inflight,
        transfer="synchronous" if synchronous else "chunked" if (variant.chunks or 0) > 1 else "direct",
        execution=variant.execution,
    )


# ---------------------------------------------------------------------------------------------------------
# Live runs
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(workload: Workload, offload: Any) -> Iterator[Any]:
    """A `Model` served by a fresh offload engine over the workload's weights (no reload), closed after."""
    from fmoe_jax.engines.offload import OffloadEngine

    # Every engine over the workload's weights shares its compiled programs: a policy compiles nothing
    # another has compiled, and an experiment that builds many engines does not pile up executables.
    engine = OffloadEngine(workload.model.module, offload, programs=workload.model.engine.programs)
    try:
        yield dataclasses.replace(workload.model, engine=engine, offload=offload)
    finally:
        engine.close()


def compilations(workload: Workload) -> int:
    """Programs compiled so far for the workload's model (every engine over it shares them)."""
    return sum(workload.model.engine.programs.compilations.values())


def run_live(
    workload: Workload,
    variant: Variant,
    *,
    measured: Sequence[Sequence[Request]] | None = None,
    warmup: Sequence[Sequence[Request]] | None = None,
    **config: Any,
) -> dict[str, Any]:
    """Serves the warm-up batches, then the measured ones (default: every eval prompt alone); returns
    per-request TTFT and TPOT (mean decode step), expert-cache counts over the measured calls, overhead
    by stage and the compilations that happened while measuring (should be 0)."""
    return run_live_interleaved(workload, [variant], measured=measured, warmup=warmup, **config)[
        variant.label
    ]


def run_live_interleaved(
    workload: Workload,
    variants: Sequence[Variant],
    *,
    measured: Sequence[Sequence[Request]] | None = None,
    warmup: Sequence[Sequence[Request]] | None = None,
    **config: Any,
) -> dict[str, dict[str, Any]]:
    """`run_live` of several variants at once, by label: every variant's model is built and warmed up
    first, then each measured batch is served by every variant in turn (the order rotating by one each
    batch) before the next batch. The machine's speed drifts over a run (on the 2-core VM by up to 30 %
    between runs minutes apart), so policies measured one after another compare that drift as much as
    themselves; interleaved, it falls on each alike and their TPOT ratios hold."""
    import fmoe_jax as fj

    if workload.simulated_only:
        raise ValueError(f"{workload.name}: replays another model's sizes, so it has no live run")
    measured = measured if measured is not None else batches(workload.eval[: workload.args.live_requests], 1)
    warmup = warmup if warmup is not None else batches(workload.store[: workload.args.warmup], 1)
    if len({v.label for v in variants}) != len(variants):
        raise ValueError(f"variant labels must differ: {[v.label for v in variants]}")
    new_tokens = workload.args.new_tokens
    tallies = {v.label: _LiveTally() for v in variants}
    with contextlib.ExitStack() as stack:
        models = {}
        for v in variants:
            offload = offload_config(workload, v, calls=[*warmup, *measured], simulated=False, **config)
            models[v.label] = stack.enter_context(serving(workload, offload))
            for batch in warmup:
                fj.generate(models[v.label], [r.ids for r in batch], new_tokens, stop_at_eos=False)
        labels = list(models)
        for i, batch in enumerate(measured):
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                before = compilations(workload)
                out = fj.generate(models[label], [r.ids for r in batch], new_tokens, stop_at_eos=False)
                tallies[label].add(len(batch), out.stats, compilations(workload) - before)
    return {label: tally.result() for label, tally in tallies.items()}


class _LiveTally:
    """One variant's live numbers over its measured calls."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = dict(ttft_s=[], tpot_s=[], decode_step_s=[], hits=0, misses=0)
        self.out |= dict(late_prefetches=0, prefetches=0, wasted_prefetches=0, bytes_to_device=0)
        self.out |= dict(overhead_s={}, iterations=0, peak_cache_bytes=0, compilations=0, requests=0)

    def add(self, rows: int, stats: Any, compiled: int) -> None:
        out = self.out
        out["ttft_s"] += [stats.ttft_s] * rows
        out["tpot_s"] += [stats.tpot_s] * rows
        out["decode_step_s"] += stats.decode_step_s
        out["iterations"] += 1 + len(stats.decode_step_s)
        for name in ("hits", "misses", "late_prefetches", "prefetches", "wasted_prefetches"):
            out[name] += stats[name]
        out["bytes_to_device"] += stats.bytes_to_device
        out["peak_cache_bytes"] = max(out["peak_cache_bytes"], stats.peak_cache_bytes)
        for stage, seconds in stats.overhead_s.items():
            out["overhead_s"][stage] = out["overhead_s"].get(stage, 0.0) + seconds
        out["compilations"] += compiled
        out["requests"] += rows
        out["extra"] = {k: v for k, v in stats.extra.items() if isinstance(v, (int, float, str))}

    def result(self) -> dict[str, Any]:
        out = self.out
        out["hit_rate"] = out["hits"] / max(1, out["hits"] + out["misses"])
        out["median_ttft_s"] = float(np.median(out["ttft_s"]))
        out["median_tpot_s"] = float(np.median(out["tpot_s"]))
        return out


# ---------------------------------------------------------------------------------------------------------
# Simulated runs
# ---------------------------------------------------------------------------------------------------------


def run_sim(
    workload: Workload,
    variant: Variant,
    hardware: str,
    *,
    measured: Sequence[Sequence[Request]] | None = None,
    warmup: Sequence[Sequence[Request]] | None = None,
    host: str | None = None,
    model: Any = None,
    matcher_s: float = 0.0,
    **config: Any,
) -> Any:
    """Replays the warm-up batches, then the measured ones, at the preset's sizes (or `model`'s, a
    `ModelPreset`) on `hardware`, with the `host` CPU preset beside it (`cost_model.HOSTS`; for hybrid
    execution); fmoe's matcher takes `matcher_s` host seconds per context (`simulate`; 0: free)."""
    from fmoe_jax.offload.cost_model import HARDWARE, HOSTS
    from fmoe_jax.offload.simulator import simulate

    measured = measured if measured is not None else batches(workload.eval, 1)
    warmup = warmup if warmup is not None else batches(workload.store[: workload.args.warmup], 1)
    offload = offload_config(workload, variant, calls=[*warmup, *measured], simulated=True, **config)
    return simulate(
        [batch_trace(b) for b in measured],
        offload,
        model=model or workload.preset,
        hardware=HARDWARE[hardware],
        host=HOSTS[host] if host else None,
        router_weights=workload.router_weights,
        warmup=[batch_trace(b) for b in warmup],
        **({} if variant.chunks is None else {"chunks": variant.chunks}),
        **({} if variant.finish_started else {"finish_started": False}),
        matcher_s=matcher_s,
    )


def sim_row(result: Any) -> dict[str, Any]:
    return dict(
        hit_rate=result.hit_rate,
        median_ttft_s=result.median_ttft_s,
        median_tpot_s=result.median_tpot_s,
        stall_s=result.stall_s,
        gb_to_device=result.bytes_to_device / 1e9,
        requests=len(result.ttft_s),
    )


# ---------------------------------------------------------------------------------------------------------
# Result files
# ---------------------------------------------------------------------------------------------------------


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0])

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if np.isnan(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(
    name: str,
    title: str,
    payload: dict[str, Any],
    tables: dict[str, list[dict[str, Any]]],
    notes: Sequence[str],
    out: Path,
    *,
    merge: bool = False,
) -> Path:
    """Prints the tables and writes `<name>.json` and `<name>.md` (the PNG is the experiment's own). With
    `merge`, the models run now join (or replace) the saved results' other models (`merged_results`)."""
    command = command_line()
    for caption, rows in tables.items():
        print(f"\n{caption}")
        print_table(rows)
    if merge and (Path(out) / f"{name}.json").exists():
        payload, tables, notes, command = merged_results(saved(name, out), payload, tables, notes, command)
    command = payload.get("command", command)  # an experiment's own merge keeps the whole run's
    save(name, {"command": command, **payload, "tables": tables, "notes": list(notes)}, out)
    m = machine()
    lines = [
        f"# {title}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {m['processor']}, {m['cpus']} CPUs, {m['platform']}, jax {m['jax']} ({m['backend']})  ",
        f"Date: {m['date']}",
        "",
    ]
    for caption, rows in tables.items():
        lines += [f"### {caption}", "", markdown_table(rows)]
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    path = Path(out) / f"{name}.md"
    path.write_text(scrub_paths("\n".join(lines)))
    print(f"wrote {path}")
    return path


def merged_results(
    old: dict[str, Any], payload: dict[str, Any], tables: dict, notes: Sequence[str], command: str
) -> tuple[dict[str, Any], dict, list[str], str]:
    """Saved results with the models of a partial run added or replaced: their entries, tables (captions
    start with the model's name) and settings notes; the saved command (the whole run's, which `rerun`
    repeats) stays, and the partial run's command is listed under `merged`. A model's entry may name the
    preset it was simulated at ("gpt-oss-20b-routing@int4 at gpt-oss-20b (int4 experts)") where its
    captions and notes name the model alone; notes of no model (the experiment's own) appear once."""
    models = list(payload["models"])
    names = {*models, *(m.split(" at ", 1)[0] for m in models)}

    def mine(text: str) -> bool:
        return any(text.startswith(f"{m}:") or text.startswith(f"{m},") for m in names)

    merged = {**old, **{k: v for k, v in payload.items() if k != "models"}}
    merged["models"] = {**old["models"], **payload["models"]}
    merged["args"] = old.get("args", payload.get("args"))
    merged["merged"] = [*old.get("merged", []), {"command": command, "models": models}]
    for key in ("command", "tables", "notes", "machine"):
        merged.pop(key, None)
    old_tables = {caption: rows for caption, rows in old["tables"].items() if not mine(caption)}
    old_notes = [n for n in dict.fromkeys(old["notes"]) if not mine(n) and n not in notes]
    return merged, {**old_tables, **tables}, [*old_notes, *notes], old["command"]


def simulated_sizes(payload: dict[str, Any], model: str) -> str:
    """The sizes the simulator charged for `model`'s traces (`sizes_phrase`), read from the table captions."""
    for caption in payload.get("tables", {}):
        if caption.startswith(f"{model}, simulated at ") and " sizes" in caption and " on " in caption:
            return caption.split("simulated at ", 1)[1].split(" on ", 1)[0]
    return "the preset's sizes"


def settings_note(workload: Workload) -> str:
    if not workload.recorded:
        from benchmarks import real_routing

        return real_routing.settings_note(workload)
    a, cfg = workload.args, workload.config
    eams = "" if a.eam_capacity == a.store_capacity else f" (MoE-Infinity: {a.eam_capacity} EAMs)"
    sizes = ""
    if workload.trace_layers != workload.preset.num_layers:
        sizes = (
            f" (traces of {cfg.num_moe_layers} MoE layers replayed with the per-layer sizes of "
            f"{workload.preset.name}, which has {workload.preset.num_layers}: not projected onto its layer "
            "count, so a simulated time is that of those layers, not of the whole model)"
        )
    return (
        f"{workload.name}: {cfg.num_moe_layers} MoE layers x {cfg.num_experts} experts, top-{cfg.top_k}; "
        f"prompts '{Path(a.prompts).name}', {len(workload.store)} store / {len(workload.eval)} "
        f"{getattr(a, 'split', 'eval')} (7:3, seed {a.seed}), prompts cut to {a.prompt_tokens} tokens, "
        f"{a.new_tokens} new tokens, "
        f"greedy; cache {workload.slots(a.budget)} of {workload.total_experts} experts ({a.budget:.0%}), "
        f"d = {a.prefetch_distance}, store capacity {a.store_capacity}{eams}, "
        f"{a.warmup} warm-up store prompts; "
        f"simulated sizes: {workload.preset.name} ({workload.preset.expert_bytes / 2**20:.0f} MiB per "
        f"expert){sizes}"
    )


def gap_closed(tpot: dict[str, float], label: str = "fmoe", bound: str = "oracle") -> dict[str, Any]:
    """The share of the gap from the best baseline (the fastest row that is neither `label`, `bound` nor
    `resident`) down to `bound` (Belady's foresight) that `label` closes, from TPOT by policy: 1 at the
    bound, 0 no faster than the best baseline, below 0 slower; {} without the three."""
    baselines = {p: t for p, t in tpot.items() if p not in (label, bound, "resident")}
    if label not in tpot or bound not in tpot or not baselines:
        return {}
    best = min(baselines, key=baselines.__getitem__)
    gap = baselines[best] - tpot[bound]
    return dict(
        best_baseline=best,
        best_tpot=baselines[best],
        **{f"{label}_tpot": tpot[label], f"{bound}_tpot": tpot[bound]},
        gap_closed=(baselines[best] - tpot[label]) / gap if gap > 0 else float("nan"),
    )


def versus_fmoe(rows: Sequence[dict[str, Any]], tpot: str, label: str = "fmoe") -> list[dict[str, Any]]:
    """fMoE against every other row of a table: hit rates side by side and fMoE's TPOT over the row's
    (below 1: fMoE faster)."""
    by = {r["policy"]: r for r in rows}
    if label not in by:
        return []
    f = by[label]
    return [
        dict(
            against=name,
            hit_rate=r["hit_rate"],
            fmoe_hit_rate=f["hit_rate"],
            tpot=r[tpot],
            fmoe_tpot=f[tpot],
            fmoe_tpot_ratio=f[tpot] / r[tpot],
        )
        for name, r in by.items()
        if name != label
    ]
