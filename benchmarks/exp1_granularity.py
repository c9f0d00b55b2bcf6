"""Experiment 1 (paper figures 3 and 4): coarse (request-level) vs fine (iteration-level) routing.

    .venv/bin/python -m benchmarks.exp1_granularity [--model NAME_OR_DIR ...] [--prompts domains|FILE]

Entropy (figure 3), from the evaluation requests' routing recorded live: per MoE layer, `fine` is the
entropy of one decode iteration's router distribution (averaged over iterations and requests), `coarse`
that of the request's aggregate (the mean router distribution over all its tokens, what a request-level
activation matrix sees), `coarse_counts` that of its aggregated top-k picks; `through_iterations[t]` is the
layer-mean entropy of the aggregate over the first t + 1 decode iterations (figure 3c).

Prediction hit rate against prefetch distance (figure 4): for every decode token of the evaluation requests
and every MoE layer l >= d, the experts predicted for layer l with what is known when layer l - d has routed,
k experts each (k = the model's top-k), scored by the share of layer l's true top-k they contain:
  - fine (fMoE's expert map): trajectory search over layers 0..l-d of this iteration in an `ExpertMapStore`
    built from the store requests (`store_from_traces`), top-k of the matched map's row l;
  - coarse (MoE-Infinity's activation matrix): the request's decode EAM (earlier decode iterations plus this
    one up to layer l - d) matched by cosine against the store requests' EAM collection (`eamc_from_traces`,
    same matching as `MoEInfinity.predicted_activation`), top-k of the matched row l;
  - speculate (Mixtral-Offloading / ProMoE's residual trick): layer l's router applied to layer l - d's
    router input;
  - popularity: the k experts layer l picks most often in the store requests.
This isolates prediction: no cache, no timing. Cache hit rates against d through the simulator are in
experiment 6. Writes `exp1_granularity.{json,md,png}` to --out.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import harness as h
from benchmarks.common import HelpFormatter, save_png
from benchmarks.routing_analysis import entropy_bits

NAME = "exp1_granularity"
METHODS = ("fine", "coarse", "speculate", "popularity")


def entropies(requests: list[h.Request]) -> dict[str, list[float]]:
    fine, coarse, counts, through = [], [], [], []
    for r in requests:
        its = r.trace.requests[0].iterations
        probs = np.concatenate([it.probs for it in its])  # [n, L, J]
        ids = np.concatenate([it.ids for it in its])  # [n, L, k]
        decode = np.stack([it.probs[0] for it in its[1:]])  # [t, L, J]
        picks = np.stack(
            [np.bincount(ids[:, m].ravel(), minlength=probs.shape[-1]) for m in range(ids.shape[1])]
        )
        fine.append(entropy_bits(decode).mean(axis=0))
        coarse.append(entropy_bits(probs.mean(axis=0)))
        counts.append(entropy_bits(picks.astype(np.float64)))
        running = np.cumsum(decode, axis=0) / np.arange(1, len(decode) + 1)[:, None, None]
        through.append(entropy_bits(running).mean(axis=1))
    n = min(len(t) for t in through)
    return dict(
        fine=np.mean(fine, axis=0).tolist(),
        coarse=np.mean(coarse, axis=0).tolist(),
        coarse_counts=np.mean(counts, axis=0).tolist(),
        through_iterations=np.mean([t[:n] for t in through], axis=0).tolist(),
    )


def decode_tokens(requests: list[h.Request]) -> dict[str, np.ndarray]:
    """Every decode token of the requests: probs [N, L, J], ids [N, L, k], hidden [N, L, D], and for the
    coarse predictor the request's decode EAM before the token [N, L, J] and whether it is the first."""
    probs, ids, hidden, before, first = [], [], [], [], []
    for r in requests:
        its = r.trace.requests[0].iterations[1:]
        eam = np.zeros(its[0].probs.shape[1:])
        for i, it in enumerate(its):
            probs.append(it.probs[0])
            ids.append(it.ids[0])
            hidden.append(it.hidden[0])
            before.append(eam.copy())
            first.append(i == 0)
            for m in range(eam.shape[0]):
                eam[m] += np.bincount(it.ids[0, m], minlength=eam.shape[1])
    return dict(
        probs=np.stack(probs),
        ids=np.stack(ids),
        hidden=np.stack(hidden),
        before=np.stack(before),
        first=np.array(first),
    )


def top_k_recall(scores: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each row's true experts `truth` [N, k] among the top-k of `scores` [N, J]."""
    k = truth.shape[1]
    predicted = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(p) & set(t)) / k for p, t in zip(predicted, truth, strict=True)]))


def prediction_hit_rates(w: h.Workload, distances: list[int]) -> dict[str, dict[int, list[float]]]:
    """Per method and distance d, the hit rate of each target layer l >= d (nan below d)."""
    from fmoe_jax.offload.policies import store_from_traces
    from fmoe_jax.offload.policies.moe_infinity import eamc_from_traces

    cfg = w.config
    num_layers, num_experts = cfg.num_moe_layers, cfg.num_experts
    tokens = decode_tokens(w.eval)
    store_traces = [r.trace for r in w.store]
    eamc = eamc_from_traces(store_traces, capacity=w.args.eam_capacity)["decode"]
    popularity = np.zeros((num_layers, num_experts))
    for t in store_traces:
        for it in t.requests[0].iterations[1:]:
            for m in range(num_layers):
                popularity[m] += np.bincount(it.ids[0, m], minlength=num_experts)
    out = {m: {} for m in METHODS}
    for d in distances:
        store = store_from_traces(store_traces, capacity=w.args.store_capacity, prefetch_distance=d)
        rates = {m: [float("nan")] * num_layers for m in METHODS}
        for layer in range(d, num_layers):
            seen = layer - d  # the last layer routed when layer `layer` is predicted
            truth = tokens["ids"][:, layer]  # [N, k]
            _, maps = store.match_traj(tokens["probs"][:, : seen + 1])
            rates["fine"][layer] = top_k_recall(maps[:, layer], truth)
            coarse = []
            for n in range(len(truth)):
                query = tokens["before"][n].copy()
                query[: seen + 1] += np.eye(num_experts)[tokens["ids"][n, : seen + 1]].sum(axis=1)
                observed = np.arange(num_layers) <= seen if tokens["first"][n] else np.ones(num_layers, bool)
                coarse.append(eamc.stored[int(np.argmax(eamc.similarity(query, observed)))][layer])
            rates["coarse"][layer] = top_k_recall(np.stack(coarse), truth)
            logits = tokens["hidden"][:, seen] @ w.router_weights[layer]  # [N, J]
            rates["speculate"][layer] = top_k_recall(logits, truth)
            rates["popularity"][layer] = top_k_recall(np.tile(popularity[layer], (len(truth), 1)), truth)
        for m in METHODS:
            out[m][d] = rates[m]
    return out


def plot(payload: dict, path) -> None:
    """Figures 3 and 4 from the saved results (routing recorded live, greedy decoding)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = payload["results"]
    where = f"{h.mode_title('live', payload['machine']['backend'])} routing traces"
    fig, axes = plt.subplots(len(results), 3, figsize=(14, 3.8 * len(results)), squeeze=False)
    for row, (name, r) in zip(axes, results.items(), strict=True):
        e = r["entropy"]
        layers = np.arange(len(e["fine"]))
        row[0].bar(layers - 0.2, e["coarse"], 0.4, label="coarse (request)")
        row[0].bar(layers + 0.2, e["fine"], 0.4, label="fine (iteration)")
        row[0].axhline(r["max_entropy"], color="grey", lw=0.8, ls="--", label="uniform")
        row[0].set(xlabel="MoE layer", ylabel="bits")
        row[0].set_title(f"{where}\n{name}: routing entropy per layer", fontsize=9)
        row[0].set_ylim(0, 1.3 * r["max_entropy"])  # headroom for the legend, clear of the bars
        row[0].legend(fontsize=8, loc="upper center", ncol=3)
        row[1].plot(e["through_iterations"])
        row[1].set(xlabel="decode iterations", ylabel="bits")
        row[1].set_title(f"{where}\n{name}: entropy of the aggregate through iterations", fontsize=9)
        for method, by_d in r["hit_rate_by_distance"].items():
            ds = sorted(by_d, key=int)
            row[2].plot([int(d) for d in ds], [np.nanmean(by_d[d]) for d in ds], marker="o", label=method)
        row[2].set(xlabel="d (layers)", ylabel="top-k hit rate")
        row[2].set_title(f"{where}\n{name}: prediction hit rate vs prefetch distance", fontsize=9)
        row[2].set_ylim(0, 1.25)
        row[2].set_yticks(np.linspace(0, 1, 6))
        row[2].legend(fontsize=8, loc="upper center", ncol=4)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    h.add_arguments(parser)
    args = parser.parse_args(argv)
    results, tables, notes = {}, {}, []
    for name in args.model:
        w = h.load_workload(name, args)
        w.model.close()
        notes.append(h.settings_note(w))
        cfg = w.config
        e = entropies(w.eval)
        distances = list(range(1, cfg.num_moe_layers))
        rates = prediction_hit_rates(w, distances)
        results[w.name] = dict(
            entropy=e,
            max_entropy=float(np.log2(cfg.num_experts)),
            hit_rate_by_distance={m: {str(d): v for d, v in by_d.items()} for m, by_d in rates.items()},
            decode_tokens=sum(len(r.trace.requests[0].iterations) - 1 for r in w.eval),
        )
        tables[
            f"{w.name}: routing entropy per MoE layer (bits; uniform = {np.log2(cfg.num_experts):.2f})"
        ] = [
            dict(layer=m, coarse=e["coarse"][m], coarse_counts=e["coarse_counts"][m], fine=e["fine"][m])
            for m in range(cfg.num_moe_layers)
        ] + [dict(layer="mean", **{k: float(np.mean(e[k])) for k in ("coarse", "coarse_counts", "fine")})]
        tables[
            f"{w.name}: prediction hit rate (top-{cfg.top_k}) vs prefetch distance, mean over layers >= d"
        ] = [dict(d=d, **{m: float(np.nanmean(rates[m][d])) for m in METHODS}) for d in distances]
        notes.append(
            f"{w.name}: {results[w.name]['decode_tokens']} decode tokens of {len(w.eval)} eval requests; "
            f"store: {len(w.store)} requests"
        )
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    h.write_results(
        NAME, "Experiment 1: coarse vs fine routing (figures 3 and 4)", payload, tables, notes, args.out
    )
    plot(h.saved(NAME, args.out), args.out / f"{NAME}.png")
    return payload


if __name__ == "__main__":
    main()
