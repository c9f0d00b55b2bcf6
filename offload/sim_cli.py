"""`fmoe-sim` (also `python -m fmoe_jax.offload.simulator`): replays routing traces through a policy at a
model's sizes on a hardware preset, and prints a one-screen summary (and `--json` a result file).

    fmoe-sim ../shared/data/routing/gpt-oss-20b --limit 20 --policy fmoe \\
        --model-preset gpt_oss --hardware rtx_3090 --budget 0.25
    fmoe-sim --list-presets

`--policy`, `--hardware` and `--budget` (or `--cache-experts`) take comma-separated lists: every combination
is replayed from the same traces (a sweep, `--jobs N` of them at a time in separate processes), and a table
of the points replaces the summary.

A TRACE is a trace saved by `RoutingTrace.save` (the `.npz`/`.json` pair, given with either suffix or none),
replayed as the batch it was recorded as, or routing recorded elsewhere (`RoutingTrace.from_external`: a
routing-set directory or a `.jsonl` file), whose requests are replayed one after another, each its own batch.
`--warmup` traces run first through the same policy and cache and are left out of the numbers (a TRACE that
is also a warm-up gets a note: a policy that learns has seen what is measured). Preset names
ignore case and separators (`--hardware RTX-3090`). fmoe on traces without semantic embeddings (routing
recorded elsewhere) matches on the routing alone, and says so. Every number printed is simulated.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from . import cost_model
from .config import OffloadConfig
from .files import unwritable, write_atomically
from .policies import POLICIES, accepted_options
from .projection import MODES, fit_layers
from .simulator import Replay, SimResult, common_meta
from .trace import RoutingTrace


class UsageError(Exception):
    """A mistake on the command line or in an input file: printed as one line, exit status 2."""


def _squashed(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def preset_name(names: Iterable[str]) -> Callable[[str], str]:
    """An argparse `type` for a preset's name: case and separators do not matter ("RTX-3090", "rtx3090" and
    "rtx_3090" name one preset); a name that matches none is passed on as given, for argparse's error."""
    known = {_squashed(name): name for name in names}
    return lambda text: known.get(_squashed(text), text)


def model_presets() -> dict[str, cost_model.ModelPreset]:
    """Model presets by the names `--model-preset` takes: `cost_model.MODELS`' keys (model families) and
    every preset's model name (`cost_model.PRESETS`, several sizes of a family), lower case."""
    out = dict(cost_model.MODELS)
    for preset in (*cost_model.MODELS.values(), *cost_model.PRESETS.values()):
        out.setdefault(preset.name.lower(), preset)
    return out


def listed(convert: Callable[[str], Any], choices: Sequence[str] | None = None) -> Callable[[str], list]:
    """An argparse `type` for a comma-separated list, each item converted (and, given `choices`, one of
    them; the error lists them, as argparse's own)."""

    def parse(text: str) -> list:
        items = [convert(item.strip()) for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected one or more comma-separated values, got {text!r}")
        for item in items:
            if choices is not None and item not in choices:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {item!r} (choose from {', '.join(map(repr, choices))})"
                )
        return items

    return parse


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--policy-option {text!r}: expected key=value")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value  # a bare string


def read_traces(paths: Sequence[str], model: cost_model.ModelPreset, limit: int | None) -> list[RoutingTrace]:
    """The batches the TRACE arguments replay, in order (see the module docstring), each TRACE checked
    against the model preset's expert count."""
    num_experts, batches = model.num_experts, []
    for name in paths:
        path = Path(name)
        external = path.is_dir() or path.suffix == ".jsonl"
        try:
            if external:  # a JSONL file does not say how many experts a layer has: the preset's
                trace = RoutingTrace.from_external(
                    path, num_experts=num_experts if path.suffix == ".jsonl" else None
                )
            else:
                trace = RoutingTrace.load(path)
        except (OSError, ValueError, KeyError) as err:
            raise UsageError(f"cannot read routing trace {name}: {err}") from None
        _check(trace, model, name)
        requests = trace.requests[:limit] if limit else trace.requests
        if external:
            batches += [RoutingTrace(trace.meta, [request]) for request in requests]
        else:
            batches.append(RoutingTrace(trace.meta, requests))
    return batches


def _check(trace: RoutingTrace, model: cost_model.ModelPreset, name: str) -> None:
    if trace.meta.get("num_experts") != model.num_experts:
        raise UsageError(
            f"routing trace {name} routes over {trace.meta.get('num_experts')} experts a layer, but model "
            f"preset {model.name!r} has {model.num_experts}; pick the preset of the model that was traced"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fmoe-sim",
        description=__doc__,
        formatter_class=type(
            "Formatter", (argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter), {}
        ),
    )
    parser.add_argument("traces", nargs="*", metavar="TRACE", help="routing traces to replay (measured)")
    policies = sorted(POLICIES)
    parser.add_argument(
        "--policy",
        default="on_demand_lru",
        type=listed(str, policies),
        metavar="POLICY[,POLICY...]",
        help=f"offload policy, or several to compare ({', '.join(policies)})",
    )
    parser.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy option (VALUE read as JSON, else a string); repeat for more. With several policies "
        "each takes those it accepts",
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model-preset", default=None, help="sizes to charge: a preset (see --list-presets)")
    model.add_argument("--model-config", type=Path, default=None, help="sizes from a model's config.json")
    hardware, hosts = sorted(cost_model.HARDWARE), sorted(cost_model.HOSTS)
    parser.add_argument(
        "--hardware",
        default="rtx_3090",
        type=listed(preset_name(hardware), hardware),
        metavar="HARDWARE[,HARDWARE...]",
        help=f"accelerator preset, or several ({', '.join(hardware)})",
    )
    parser.add_argument(
        "--host", default=None, type=preset_name(hosts), choices=hosts, help="host CPU (hybrid)"
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--budget",
        type=listed(float),
        default="0.25",
        metavar="SHARE[,SHARE...]",
        help="cache budget, a share of all experts, or several",
    )
    budget.add_argument(
        "--cache-experts",
        type=listed(int),
        default=None,
        metavar="N[,N...]",
        help="cache budget in experts (slots), or several",
    )
    parser.add_argument("--warmup", nargs="+", default=[], metavar="TRACE", help="replayed first, unmeasured")
    parser.add_argument("--execution", choices=("copy", "hybrid"), default="copy")
    parser.add_argument(
        "--layers",
        choices=MODES,
        default="project",
        help="a trace of fewer MoE layers than the model: project it onto the whole model (see "
        "offload/projection.py), refuse it, or replay the trace's own layers",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="replay only the first N requests of each TRACE"
    )
    parser.add_argument(
        "--warmup-limit",
        type=int,
        default=None,
        help="replay only the first N requests of each --warmup TRACE",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="also write the result as JSON"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="points of a sweep replayed at once, each in its own process"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list-presets", action="store_true", help="list model, hardware and host presets")
    return parser


def list_presets() -> str:
    def describe(key: str, p: cost_model.ModelPreset) -> str:
        return (
            f"  {key:18s} {p.name}: {p.num_layers} MoE layers x {p.num_experts} experts, top {p.top_k}, "
            f"{p.expert_bytes / 2**20:.1f} MiB an expert"
        )

    lines = ["model presets (--model-preset, by family or by the model's name):"]
    lines += [describe(key, p) for key, p in cost_model.MODELS.items()]
    by_family = set(cost_model.MODELS.values())
    lines += [describe(p.name.lower(), p) for p in cost_model.PRESETS.values() if p not in by_family]
    lines.append("hardware presets (--hardware):")
    lines += [f"  {key:18s} {h.name}" for key, h in cost_model.HARDWARE.items()]
    lines.append("host presets (--host, hybrid execution):")
    lines += [f"  {key:18s} {h.name}" for key, h in cost_model.HOSTS.items()]
    return "\n".join(lines)


def _model(args: argparse.Namespace) -> cost_model.ModelPreset:
    if args.model_config is not None:
        from fmoe_jax.models import config_from_hf

        try:
            hf = json.loads(args.model_config.read_text())
            return cost_model.ModelPreset.from_config(config_from_hf(hf), name=args.model_config.parent.name)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"cannot read model config {args.model_config}: {err}") from None
    presets = model_presets()
    name = preset_name(presets)(args.model_preset or "")
    if name not in presets:
        raise UsageError(
            f"unknown model preset {args.model_preset!r}; choose a model family "
            f"({', '.join(cost_model.MODELS)}) or a model's name (--list-presets lists them all), or give "
            "--model-config"
        )
    return presets[name]


def _offload(
    args: argparse.Namespace, total_experts: int, traces: Sequence[RoutingTrace], *, quiet: bool = False
) -> OffloadConfig:
    """The replay's offload configuration for one point (`args.policy` and its budget scalars). In a sweep of
    several policies (`args.policies`) each takes the options it accepts; one that none takes is refused."""
    options = dict(_option(text) for text in args.policy_option)
    accepted = accepted_options(args.policy)
    policies = getattr(args, "policies", [args.policy])
    if len(policies) > 1:
        if unknown := sorted(k for k in options if not any(k in accepted_options(p) for p in policies)):
            raise UsageError(f"no policy of {', '.join(policies)} takes the option(s) {', '.join(unknown)}")
        options = {key: value for key, value in options.items() if key in accepted}
    if "asynchronous" in accepted:
        options.setdefault("asynchronous", False)  # a matcher thread's timing is not the simulated clock's
    if "semantic" in accepted and "semantic" not in options and not _has_embeds(traces):
        options["semantic"] = False  # routing recorded elsewhere carries no embeddings; said, not silent
        if not quiet:
            print(
                f"fmoe-sim: note: the traces carry no semantic embeddings, so {args.policy} matches on the "
                "routing alone (--policy-option semantic=false)",
                file=sys.stderr,
            )
    if args.cache_experts is not None:
        slots = args.cache_experts
    else:
        if not 0 < args.budget <= 1:
            raise UsageError(f"--budget must be a share of the experts in (0, 1], got {args.budget}")
        slots = max(1, round(args.budget * total_experts))
    try:
        return OffloadConfig(
            policy=args.policy, policy_options=options, cache_experts=slots, execution=args.execution
        )
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


def _has_embeds(traces: Sequence[RoutingTrace]) -> bool:
    return all(it.embeds is not None for trace in traces for r in trace.requests for it in r.iterations)


@dataclasses.dataclass
class Workload:
    """What every point of a run replays: the batches (warm-up first), fitted to the model's layers."""

    model: cost_model.ModelPreset
    batches: list[RoutingTrace]
    warmup: int  # the first `warmup` batches are the warm-up
    meta: dict[str, Any]

    @property
    def total_experts(self) -> int:
        return self.meta["num_layers"] * self.meta["num_experts"]


def load(args: argparse.Namespace, *, quiet: bool = False) -> Workload:
    """Reads and checks the arguments' traces (`quiet`: without the notes, as a sweep's workers)."""
    model = _model(args)
    if args.execution == "hybrid" and args.host is None:
        raise UsageError(
            "--execution hybrid computes misses on the host CPU: give --host (see --list-presets)"
        )
    warmup = read_traces(args.warmup, model, args.warmup_limit)
    measured = read_traces(args.traces, model, args.limit)
    same = {Path(p).resolve() for p in args.warmup} & {Path(p).resolve() for p in args.traces}
    if same and not quiet:
        print(
            f"fmoe-sim: note: both warm-up and measured: {', '.join(sorted(map(str, same)))}; the measured "
            "requests were replayed in the warm-up first (a policy that learns has seen them)",
            file=sys.stderr,
        )
    try:
        everything = fit_layers([*warmup, *measured], model.num_layers, args.layers)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return Workload(model, everything, len(warmup), common_meta(everything))


def points(args: argparse.Namespace) -> list[argparse.Namespace]:
    """Every combination of the listed hardware, budgets and policies, in that order: the arguments of one
    replay each, with those three as single values."""
    if args.cache_experts is not None:
        budgets = [dict(budget=None, cache_experts=n) for n in args.cache_experts]
    else:
        budgets = [dict(budget=b, cache_experts=None) for b in args.budget]
    policies = list(dict.fromkeys(args.policy))
    return [
        argparse.Namespace(
            **{**vars(args), "hardware": hardware, "policy": policy, **budget, "policies": policies}
        )
        for hardware, budget, policy in itertools.product(args.hardware, budgets, policies)
    ]


def replay(
    point: argparse.Namespace, work: Workload, *, progress: bool = True, quiet: bool = False
) -> SimResult:
    """Replays the workload at one point; returns the result of the measured batches."""
    offload = _offload(point, work.total_experts, work.batches, quiet=quiet)
    try:
        replayer = Replay(
            offload,
            meta=work.meta,
            model=work.model,
            hardware=cost_model.HARDWARE[point.hardware],
            host=cost_model.HOSTS[point.host] if point.host else None,
            check=work.batches,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        bar = tqdm(total=len(work.batches), unit="batch", disable=not progress, desc="replaying")
        with bar:
            for i, trace in enumerate(work.batches):
                if i == work.warmup:
                    replayer.reset_statistics()
                replayer.run(trace)
                bar.update()
    finally:
        result = replayer.close()
    result.extra["trace_layers"] = work.meta.get("trace_layers", work.meta["num_layers"])
    return result


def run(args: argparse.Namespace) -> SimResult:
    """Replays the arguments' traces at their one point; returns the result of the measured ones."""
    (point,) = points(args)
    return replay(point, load(args), progress=not args.no_progress)


# A sweep's worker process: the workload it read once, for every point it is given.
_WORKLOAD: Workload | None = None


def _start_worker(args: argparse.Namespace) -> None:
    global _WORKLOAD
    _WORKLOAD = load(args, quiet=True)


def _replay_in_worker(point: argparse.Namespace) -> SimResult:
    return replay(point, _WORKLOAD, progress=False, quiet=True)


def sweep(args: argparse.Namespace) -> tuple[Workload, list[argparse.Namespace], list[SimResult]]:
    """Replays every point (`points`); each is checked before any runs. With `--jobs` above 1 the points
    run in that many processes (started afresh: each reads the traces once), in the same order of results."""
    work, todo = load(args), points(args)
    told = set()
    for point in todo:  # every option and budget checked (and each note said once) before any replay
        _offload(point, work.total_experts, work.batches, quiet=point.policy in told)
        told.add(point.policy)
    bar = tqdm(total=len(todo), unit="point", disable=args.no_progress, desc="sweeping")
    with bar:
        if args.jobs == 1:
            results = []
            for point in todo:
                results.append(replay(point, work, progress=False, quiet=True))
                bar.update()
        else:
            context = multiprocessing.get_context("spawn")  # JAX is loaded: no fork
            jobs = min(args.jobs, len(todo))
            with concurrent.futures.ProcessPoolExecutor(
                jobs, mp_context=context, initializer=_start_worker, initargs=(args,)
            ) as pool:
                results = []
                for result in pool.map(_replay_in_worker, todo):
                    results.append(result)
                    bar.update()
    return work, todo, results


def summary(
    result: SimResult, args: argparse.Namespace, model: cost_model.ModelPreset, layers: int, trace_layers: int
) -> str:
    """The one-screen summary of a replay."""
    ms = 1e3
    stall = result.stall_s / result.total_s if result.total_s else 0.0
    lines = [
        f"simulated: policy {args.policy}, {result.capacity} cache slots, {args.execution}, "
        f"{model.name} sizes on {cost_model.HARDWARE[args.hardware].name}"
        + (f" + {cost_model.HOSTS[args.host].name}" if args.host else ""),
        f"  {layers} MoE layers replayed ("
        + (
            f"the trace's {trace_layers} projected onto the model's"
            if trace_layers != layers
            else "the trace's"
        )
        + f"; the model has {model.num_layers})",
        f"  TPOT   median {result.median_tpot_s * ms:.2f} ms, mean {result.mean_tpot_s * ms:.2f} ms "
        f"({1 / result.median_tpot_s:.1f} tokens/s)"
        if result.median_tpot_s > 0
        else "  TPOT   -",
        f"  TTFT   median {result.median_ttft_s * ms:.2f} ms (first iteration of each request)",
        f"  hits   {result.hit_rate:.3f} ({result.hits} hits, {result.misses} misses, "
        f"{result.prefetches} prefetches, {result.wasted_prefetches} wasted)",
        f"  moved  {result.bytes_to_device / 1e9:.2f} GB to the device; link busy "
        f"{result.link_busy_share:.2f}, stall {stall:.2f} of the time",
        "  per-layer hit rate " + " ".join(f"{h:.2f}" for h in result.layer_hit_rate),
    ]
    if result.host_computed:
        lines.append(f"  host   {result.host_computed} experts computed on the host")
    return "\n".join(lines)


def sweep_table(work: Workload, todo: Sequence[argparse.Namespace], results: Sequence[SimResult]) -> str:
    """A sweep's points, a line each, and the fastest policy at each (hardware, budget)."""
    ms, layers = 1e3, work.meta["num_layers"]
    trace_layers = work.meta.get("trace_layers", layers)
    fitted = "the trace's"
    if trace_layers != layers:
        fitted = f"the trace's {trace_layers} projected onto the model's"
    lines = [
        f"simulated: {len(todo)} points, {work.model.name} sizes, {layers} MoE layers replayed ({fitted}; "
        f"the model has {work.model.num_layers}), {todo[0].execution}",
        f"{'hardware':12s} {'budget':>10s} {'policy':16s} {'slots':>6s} {'TPOT ms':>9s} {'tok/s':>7s} "
        f"{'TTFT ms':>9s} {'hits':>6s} {'GB moved':>9s} {'stall':>6s}",
    ]
    best: dict[tuple, tuple[float, str]] = {}
    for point, result in zip(todo, results, strict=True):
        budget = f"{point.budget:g}" if point.cache_experts is None else f"{point.cache_experts} slots"
        tpot = result.median_tpot_s
        stall = result.stall_s / result.total_s if result.total_s else 0.0
        lines.append(
            f"{point.hardware:12s} {budget:>10s} {point.policy:16s} {result.capacity:6d} "
            + (f"{tpot * ms:9.2f} {1 / tpot:7.1f}" if tpot > 0 else f"{'-':>9s} {'-':>7s}")
            + f" {result.median_ttft_s * ms:9.2f} {result.hit_rate:6.3f} {result.bytes_to_device / 1e9:9.2f}"
            f" {stall:6.2f}"
        )
        where = (point.hardware, budget)
        if tpot > 0 and (where not in best or tpot < best[where][0]):
            best[where] = (tpot, point.policy)
    if len({point.policy for point in todo}) > 1 and best:
        lines.append(
            "fastest (median TPOT): "
            + "; ".join(f"{h} {b}: {policy}" for (h, b), (_, policy) in best.items())
        )
    return "\n".join(lines)


def _record(point: argparse.Namespace, model: cost_model.ModelPreset, result: SimResult) -> dict[str, Any]:
    layers = len(result.layer_hits)
    return {
        "policy": point.policy,
        "model_preset": dataclasses.asdict(model),
        "hardware": point.hardware,
        "host": point.host,
        "budget": point.budget,
        "cache_experts": point.cache_experts,
        "trace_layers": result.extra.get("trace_layers", layers),
        "replayed_layers": layers,
        "result": result.as_dict(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_presets:
        print(list_presets())
        return 0
    if not args.traces:
        parser.error("give at least one TRACE (or --list-presets)")
    several = len(args.policy) * len(args.hardware) * len(args.cache_experts or args.budget) > 1
    try:
        if args.json is not None and (problem := unwritable(args.json)) is not None:
            raise UsageError(f"--json {args.json}: {problem}")  # before the replay, not after it
        if args.jobs < 1:
            raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
        model = _model(args)
        if several:
            work, todo, results = sweep(args)
        else:
            todo, results = points(args), [run(args)]
    except UsageError as err:
        print(f"fmoe-sim: error: {err}", file=sys.stderr)
        return 2
    command = " ".join(sys.argv if argv is None else ["fmoe-sim", *argv])
    if several:
        print(sweep_table(work, todo, results))
        pairs = zip(todo, results, strict=True)
        record = {"simulated": True, "command": command, "points": [_record(p, model, r) for p, r in pairs]}
    else:
        (point,), (result,) = todo, results
        layers = len(result.layer_hits)
        print(summary(result, point, model, layers, result.extra.get("trace_layers", layers)))
        record = {"simulated": True, "command": command, **_record(point, model, result)}
    if args.json is not None:
        try:
            write_atomically(args.json, lambda f: f.write(json.dumps(record, indent=1, default=str).encode()))
        except OSError as err:
            print(f"fmoe-sim: error: cannot write {args.json}: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
