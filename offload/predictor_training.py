"""Training of the learned expert predictors: fmoe's reuse predictor and those of the `promoe` and `duoserve`
baselines, from routing traces (datasets, offline training with optax). The policies' `from_traces(...,
"train")` call it while serving starts; `benchmarks/train_predictors.py` and `fmoe_jax.research` (which adds
evaluation) call it offline. The trained `Predictor` is `offload/predictors.py`'s.

Sources: ProMoE (Song et al. 2024, arXiv 2410.22134): per-layer predictors from intermediate hidden states,
looking `stride` layers ahead. DuoServe-MoE (`seeds/002_*` section 4): popularity and inter-layer affinity
collected offline, a state vector [history, popularity, affinity], an MLP trained with binary cross-entropy.

Letters: N tokens (samples), L MoE layers, J experts, k experts per token, D router-input width, F features,
G predictor groups (ProMoE: one MLP per target layer, G = L; DuoServe: one shared MLP, G = 1).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .predictors import Predictor, duoserve_features


# -- tokens of recorded traces ---------------------------------------------------------------------------
def _iterations(traces: Iterable[Any]) -> Iterator[Any]:
    for trace in traces:
        for request in trace.requests:
            yield from request.iterations


def _shape(traces: Sequence[Any]) -> tuple[int, int, int]:
    """(L, J, k) shared by the traces; raises when they disagree."""
    metas = {(t.meta["num_layers"], t.meta["num_experts"], t.meta["top_k"]) for t in traces}
    if len(metas) != 1:
        raise ValueError(f"traces of different models (num_layers, num_experts, top_k): {sorted(metas)}")
    return metas.pop()


def require_fields(iterations: Iterable[Any], fields: Sequence[str]) -> None:
    """Raises unless every `Iteration` holds each of `fields` (e.g. "hidden": the router inputs a predictor
    learns from), saying how to record them."""
    iterations = list(iterations)
    for name in fields:
        if any(getattr(it, name) is None for it in iterations):
            raise ValueError(
                f"the traces lack {name!r}; record them with "
                "fj.generate(model, prompts, record_trace=True, record_hidden=True)"
            )


def _tokens(traces: Sequence[Any], fields: Sequence[str], max_tokens: int | None, seed: int) -> dict:
    """Every token of every iteration, `fields` of `Iteration` stacked along N (a seeded sample of at most
    `max_tokens`, in trace order): ids `[N, L, k]`, hidden `[N, L, D]`, embeds `[N, H]`."""
    its = list(_iterations(traces))
    if not its:
        raise ValueError("the traces hold no iterations")
    require_fields(its, fields)
    total = sum(it.num_tokens for it in its)
    keep = np.ones(total, bool)
    if max_tokens is not None and total > max_tokens:
        keep[:] = False
        keep[np.random.default_rng(seed).choice(total, max_tokens, replace=False)] = True
    out, start = {name: [] for name in fields}, 0
    for it in its:
        rows = keep[start : start + it.num_tokens]
        start += it.num_tokens
        for name in fields:
            out[name].append(np.asarray(getattr(it, name))[rows])
    return {name: np.concatenate(parts) for name, parts in out.items()}


def multi_hot(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """ids `[..., k]` -> `[..., J]` float32 with ones at the chosen experts."""
    out = np.zeros((*ids.shape[:-1], num_experts), np.float32)
    np.put_along_axis(out, ids.astype(np.int64), 1.0, axis=-1)
    return out


def split_requests(traces: Sequence[Any], eval_fraction: float, seed: int = 0) -> tuple[list, list]:
    """Splits the traces' requests into (train, held-out) traces, a seeded `eval_fraction` held out."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    train, held = [], []
    rng = np.random.default_rng(seed)
    for trace in traces:
        n = len(trace.requests)
        held_out = set(rng.permutation(n)[: max(1, round(n * eval_fraction))].tolist()) if n > 1 else set()
        kind = type(trace)
        train.append(kind(trace.meta, [r for i, r in enumerate(trace.requests) if i not in held_out]))
        held.append(kind(trace.meta, [r for i, r in enumerate(trace.requests) if i in held_out]))
    return train, held


# -- features --------------------------------------------------------------------------------------------
def routing_statistics(traces: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Popularity `[L, J]` and affinity `[L - 1, J, J]` (DuoServe eqs. 2-3), counted over every token."""
    num_layers, num_experts, _ = _shape(traces)
    hot = multi_hot(_tokens(traces, ["ids"], None, 0)["ids"], num_experts)  # [N, L, J]
    counts = hot.sum(0)  # [L, J]
    popularity = counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)
    joint = np.einsum("nli,nlj->lij", hot[:, :-1], hot[:, 1:])  # [L - 1, J, J]
    affinity = joint / np.maximum(joint.sum(-1, keepdims=True), 1.0)
    return popularity.astype(np.float32), affinity.astype(np.float32)


def promoe_dataset(
    traces: Sequence[Any], stride: int, *, max_tokens: int | None = None, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """ProMoE samples: x `[L, N, D]`, the input each target layer's predictor sees, and y `[L, N, J]`, the
    experts that layer chose. Target t >= stride reads MoE layer t - stride's router input; targets below
    the stride read the token embedding (the input of the first layer), available at iteration start."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    num_layers, num_experts, _ = _shape(traces)
    tok = _tokens(traces, ["ids", "hidden", "embeds"], max_tokens, seed)
    if tok["embeds"].shape[-1] != tok["hidden"].shape[-1]:
        raise ValueError(
            f"embedding width {tok['embeds'].shape[-1]} differs from the router input width "
            f"{tok['hidden'].shape[-1]}: ProMoE's first-layer predictors need them equal"
        )
    x = np.stack([tok["embeds"] if t < stride else tok["hidden"][:, t - stride] for t in range(num_layers)])
    y = np.moveaxis(multi_hot(tok["ids"], num_experts), 1, 0)
    return x.astype(np.float32), y


def duoserve_dataset(
    traces: Sequence[Any],
    popularity: np.ndarray,
    affinity: np.ndarray,
    *,
    max_samples: int | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DuoServe samples for every target layer 1..L-1: x `[M, F]`, y `[M, J]`, target `[M]`."""
    num_layers, num_experts, _ = _shape(traces)
    if num_layers < 2:
        raise ValueError("DuoServe predicts the next layer: the model needs at least 2 MoE layers")
    per_token = num_layers - 1
    max_tokens = None if max_samples is None else max(1, max_samples // per_token)
    hot = multi_hot(_tokens(traces, ["ids"], max_tokens, seed)["ids"], num_experts)  # [N, L, J]
    xs, ys, targets = [], [], []
    for t in range(1, num_layers):
        history = hot.copy()
        history[:, t:] = 0.0
        xs.append(duoserve_features(history, t, popularity, affinity))
        ys.append(hot[:, t])
        targets.append(np.full(hot.shape[0], t, np.int32))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(targets)


# -- training --------------------------------------------------------------------------------------------
def _logits(layers: list[dict[str, jax.Array]], h: jax.Array, rng: jax.Array, dropout: float) -> jax.Array:
    """One group's MLP: h `[B, F]` -> logits `[B, J]`, with inverted dropout after each hidden layer."""
    for i, layer in enumerate(layers):
        h = h @ layer["w"] + layer["b"]
        if i < len(layers) - 1:
            h = jax.nn.relu(h)
            if dropout > 0.0:
                rng, sub = jax.random.split(rng)
                h = jnp.where(jax.random.bernoulli(sub, 1.0 - dropout, h.shape), h / (1.0 - dropout), 0.0)
    return h


@functools.partial(jax.jit, static_argnames=("dropout", "learning_rate", "l2"))
def _train_step(layers, opt_state, xb, yb, seed, step, *, dropout: float, learning_rate: float, l2: float):
    """One Adam step on the mean binary cross-entropy of every group (plus `l2` times the sum of squared
    weights): xb `[G, B, F]`, yb `[G, B, J]`."""

    def loss_fn(layers):
        rngs = jax.random.split(jax.random.fold_in(jax.random.key(seed), step), xb.shape[0])
        out = jax.vmap(functools.partial(_logits, dropout=dropout))(layers, xb, rngs)
        penalty = sum(jnp.sum(layer["w"] ** 2) for layer in layers) if l2 > 0.0 else 0.0
        return optax.sigmoid_binary_cross_entropy(out, yb).mean(-1).mean() + l2 * penalty

    loss, grads = jax.value_and_grad(loss_fn)(layers)
    updates, opt_state = optax.adam(learning_rate).update(grads, opt_state, layers)
    return optax.apply_updates(layers, updates), opt_state, loss


def _fit(
    x: np.ndarray,
    y: np.ndarray,
    hidden: Sequence[int],
    *,
    dropout: float,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    progress: bool,
    desc: str,
    l2: float = 0.0,
) -> tuple[list[dict[str, np.ndarray]], np.ndarray, np.ndarray, list[float]]:
    """Trains G independent MLPs at once (vmapped) with Adam on binary cross-entropy (multi-label).

    x `[G, N, F]`, y `[G, N, J]`; `hidden` the widths of the hidden layers (none: logistic regression).
    Returns the layers (leading G axis), mean and std `[G, F]`, and the mean training loss of each epoch.
    Seeded: same data and settings give the same weights.
    """
    from tqdm.auto import tqdm

    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    groups, n, features = x.shape
    mean = x.mean(1).astype(np.float32)
    std = x.std(1)
    std = np.where(std < 1e-6, 1.0, std).astype(np.float32)
    xs = ((x - mean[:, None]) / std[:, None]).astype(np.float32)
    y = y.astype(np.float32)
    rng = np.random.default_rng(seed)
    widths = [features, *hidden, y.shape[-1]]
    params = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        scale = np.sqrt((2.0 if i < len(widths) - 2 else 1.0) / fan_in)  # He for ReLU layers
        w = (rng.standard_normal((groups, fan_in, fan_out)) * scale).astype(np.float32)
        params.append({"w": jnp.asarray(w), "b": jnp.zeros((groups, fan_out), jnp.float32)})
    opt_state = optax.adam(learning_rate).init(params)

    batch = min(batch_size, n)
    steps = n // batch
    losses: list[float] = []
    bar = tqdm(range(epochs), desc=desc, disable=not progress, unit="epoch")
    for epoch in bar:
        order = rng.permutation(n)
        total = 0.0
        for s in range(steps):
            idx = np.sort(order[s * batch : (s + 1) * batch])
            params, opt_state, loss = _train_step(
                params,
                opt_state,
                xs[:, idx],
                y[:, idx],
                seed,
                epoch * steps + s,
                dropout=dropout,
                learning_rate=learning_rate,
                l2=l2,
            )
            total += float(loss)
        losses.append(total / steps)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    layers = [{"w": np.asarray(p["w"]), "b": np.asarray(p["b"])} for p in params]
    return layers, mean, std, losses


def _base_meta(traces: Sequence[Any], model_id: str | None) -> dict[str, Any]:
    num_layers, num_experts, top_k = _shape(traces)
    return {
        "model_id": model_id if model_id is not None else traces[0].meta.get("model_id", ""),
        "family": traces[0].meta.get("family", ""),
        "num_layers": num_layers,
        "num_experts": num_experts,
        "top_k": top_k,
    }


def train_promoe(
    traces: Sequence[Any],
    *,
    stride: int,
    model_id: str | None = None,
    hidden: Sequence[int] = (128,),
    epochs: int = 10,
    batch_size: int = 256,
    learning_rate: float = 1e-3,
    max_tokens: int | None = 50_000,
    seed: int = 0,
    progress: bool = True,
) -> Predictor:
    """ProMoE's per-layer predictors: for every MoE layer t, a small MLP from the hidden state `stride`
    layers earlier (the embedding for t < stride) to the experts layer t chooses. Traces need `hidden`."""
    traces = list(traces)
    x, y = promoe_dataset(traces, stride, max_tokens=max_tokens, seed=seed)
    layers, mean, std, losses = _fit(
        x,
        y,
        hidden,
        dropout=0.0,
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
        progress=progress,
        desc="promoe",
    )
    popularity, _ = routing_statistics(traces)
    meta = _base_meta(traces, model_id) | {
        "input_dim": int(x.shape[-1]),
        "stride": stride,
        "hidden": list(hidden),
        "epochs": epochs,
        "samples": int(x.shape[1]),
        "seed": seed,
        "train_loss": losses,
    }
    affinity = np.zeros((0, y.shape[-1], y.shape[-1]), np.float32)
    return Predictor("promoe", meta, layers, mean, std, popularity, affinity)


def train_duoserve(
    traces: Sequence[Any],
    *,
    model_id: str | None = None,
    hidden: Sequence[int] = (256, 128, 64),
    dropout: float = 0.1,
    epochs: int = 20,
    batch_size: int = 256,
    learning_rate: float = 1e-3,
    max_samples: int | None = 100_000,
    seed: int = 0,
    progress: bool = True,
) -> Predictor:
    """DuoServe's next-layer predictor: one MLP over the state [history, popularity, affinity] of every
    target layer 1..L-1, trained as multi-label classification with binary cross-entropy (section 4.2)."""
    traces = list(traces)
    popularity, affinity = routing_statistics(traces)
    x, y, _ = duoserve_dataset(traces, popularity, affinity, max_samples=max_samples, seed=seed)
    layers, mean, std, losses = _fit(
        x[None],
        y[None],
        hidden,
        dropout=dropout,
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
        progress=progress,
        desc="duoserve",
    )
    meta = _base_meta(traces, model_id) | {
        "hidden": list(hidden),
        "dropout": dropout,
        "epochs": epochs,
        "samples": int(x.shape[0]),
        "seed": seed,
        "train_loss": losses,
    }
    return Predictor("duoserve", meta, layers, mean, std, popularity, affinity)


def reuse_dataset(
    traces: Sequence[Any], *, horizon: int, max_samples: int | None = None, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """fmoe's reuse-predictor samples, one per iteration i of each request with `horizon` iterations after
    it: x `[L, N, D]`, each MoE layer's router input for the iteration's last token, and y `[N, L * J]`,
    whether each expert is used in iterations i + 1 .. i + horizon (a seeded sample of at most
    `max_samples`, in trace order)."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    num_layers, num_experts, _ = _shape(traces)
    xs, ys = [], []
    for trace in traces:
        for request in trace.requests:
            its = request.iterations
            require_fields(its, ("hidden",))
            used = [multi_hot(it.ids, num_experts).max(0) > 0 for it in its]  # [T][L, J]
            for i in range(len(its) - horizon):
                xs.append(its[i].hidden[-1])  # [L, D]
                ys.append(np.logical_or.reduce(used[i + 1 : i + 1 + horizon]).reshape(-1))
    if not xs:
        raise ValueError(f"no request of the traces has {1 + horizon} iterations: nothing to learn from")
    x, y = np.stack(xs, axis=1).astype(np.float32), np.stack(ys).astype(np.float32)
    if max_samples is not None and y.shape[0] > max_samples:
        keep = np.sort(np.random.default_rng(seed).choice(y.shape[0], max_samples, replace=False))
        x, y = x[:, keep], y[keep]
    return x, y


def _groups(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The same targets `[N, F]` for each of x's groups: `[G, N, F]` (a view, no copy)."""
    return np.broadcast_to(y, (x.shape[0], *y.shape))


def train_reuse(
    traces: Sequence[Any],
    *,
    horizon: int = 2,
    model_id: str | None = None,
    l2: Sequence[float] = (1e-6, 1e-5, 1e-4, 1e-3),
    epochs: int = 60,
    batch_size: int = 256,
    learning_rate: float = 1e-2,
    max_samples: int | None = 100_000,
    seed: int = 0,
    progress: bool = True,
) -> Predictor:
    """fmoe's reuse predictor: per MoE layer m, a logistic regression from layer m's router input of a token
    to the experts (of every layer) used in the `horizon` iterations after it. The residual stream already
    says much of what the next token will be, and so of how it will route, the more the later the layer.
    The ridge strength is the one of `l2` with the lowest loss on a fifth of the training requests held
    out (`split_requests`); the predictor is then refit on them all."""
    traces = list(traces)
    if traces:  # one trace of every request: the held-out fifth is of requests, however the traces hold them
        traces = [type(traces[0])(traces[0].meta, [r for t in traces for r in t.requests])]
    x, y = reuse_dataset(traces, horizon=horizon, max_samples=max_samples, seed=seed)
    common = dict(
        dropout=0.0,
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
        desc="reuse",
    )
    held_loss: dict[float, float] = {}
    layer_loss: dict[float, list[float]] = {}  # per MoE layer's router input
    if len(l2) > 1:
        inner, held = split_requests(traces, 0.2, seed)
        xi, yi = reuse_dataset(inner, horizon=horizon, max_samples=max_samples, seed=seed)
        xh, yh = reuse_dataset(held, horizon=horizon)
        for strength in l2:
            layers, mean, std, _ = _fit(xi, _groups(yi, xi), (), l2=strength, progress=False, **common)
            fitted = Predictor("reuse", {}, layers, mean, std, np.zeros(0), np.zeros(0))
            p = np.stack([fitted.probs(xh[m], m) for m in range(len(xh))])
            p = np.clip(p, 1e-6, 1 - 1e-6)
            loss = -(yh * np.log(p) + (1 - yh) * np.log(1 - p)).mean(axis=(1, 2))  # [L]
            held_loss[strength], layer_loss[strength] = float(loss.mean()), loss.tolist()
    strength = min(held_loss, key=held_loss.get) if held_loss else l2[0]
    layers, mean, std, losses = _fit(x, _groups(y, x), (), l2=strength, progress=progress, **common)
    popularity, _ = routing_statistics(traces)
    meta = _base_meta(traces, model_id) | {
        "input_dim": int(x.shape[-1]),
        "horizon": horizon,
        "l2": strength,
        "held_out_loss": {str(k): v for k, v in held_loss.items()},
        "held_out_loss_by_layer": layer_loss.get(strength, []),
        "epochs": epochs,
        "samples": int(y.shape[0]),
        "seed": seed,
        "train_loss": losses,
    }
    return Predictor("reuse", meta, layers, mean, std, popularity, np.zeros((0, 0, 0), np.float32))
