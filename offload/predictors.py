"""Learned expert predictors of the `promoe` and `duoserve` baselines as the policies use them: the weight
files, `Predictor.probs` (a NumPy forward pass on the host while serving) and DuoServe's state features.

Training is `offload/predictor_training.py`'s (datasets from routing traces, offline training with optax;
evaluation is research code, `fmoe_jax.research.predictor_training`); the policies
(`offload/policies/promoe.py`, `offload/policies/duoserve.py`, fmoe's reuse predictor) load the result with
`Predictor.load`.

Sources: ProMoE (Song et al. 2024, arXiv 2410.22134): per-layer predictors from intermediate hidden states,
looking `stride` layers ahead. DuoServe-MoE (`seeds/002_*` section 4): popularity and inter-layer affinity
collected offline, a state vector [history, popularity, affinity], an MLP trained with binary cross-entropy.

Letters: N tokens (samples), L MoE layers, J experts, k experts per token, D router-input width, F features,
G predictor groups (ProMoE: one MLP per target layer, G = L; DuoServe: one shared MLP, G = 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .files import write_atomically

FORMAT_VERSION = 1
Kind = Literal["promoe", "duoserve", "reuse"]


# -- the predictor ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Predictor:
    """Trained weights of one policy's predictors plus what identifies the model they were trained for.

    Attributes:
      kind: "promoe" or "duoserve".
      meta: model_id, num_layers, num_experts, top_k, input_dim (ProMoE: D), stride (ProMoE), hidden,
        training settings and per-epoch losses.
      layers: the MLP, `[{"w": [G, in, out], "b": [G, out]}, ...]`; ReLU between layers, sigmoid at the end.
      mean, std: `[G, F]` feature standardisation, applied before the first layer.
      popularity: `[L, J]` share of each layer's selections that go to each expert (DuoServe eq. 2).
      affinity: `[L - 1, J, J]` P(expert j at layer l + 1 | expert i at layer l) (DuoServe eq. 3).
    """

    kind: Kind
    meta: dict[str, Any]
    layers: list[dict[str, np.ndarray]]
    mean: np.ndarray
    std: np.ndarray
    popularity: np.ndarray
    affinity: np.ndarray

    def probs(self, x: np.ndarray, group: int = 0) -> np.ndarray:
        """Per-expert probabilities `[N, J]` for features `x` `[N, F]` of predictor `group` (ProMoE: the
        target layer). Float32 NumPy: microseconds for a decode batch, no device round trip."""
        h = self.logits(x, group)
        return 0.5 * (np.tanh(0.5 * h) + 1.0)  # the sigmoid, without overflow for large |h|

    def logits(self, x: np.ndarray, group: int = 0) -> np.ndarray:
        """The log-odds behind `probs`."""
        h = (np.asarray(x, np.float32) - self.mean[group]) / self.std[group]
        for i, layer in enumerate(self.layers):
            h = h @ layer["w"][group] + layer["b"][group]
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        return h

    def duoserve_probs(self, history: np.ndarray, target: int) -> np.ndarray:
        """DuoServe: probabilities `[N, J]` of layer `target`'s experts from the history `[N, L, J]` of the
        experts each token chose in the layers before it (see `duoserve_features`)."""
        return self.probs(duoserve_features(history, target, self.popularity, self.affinity))

    # -- identity ----------------------------------------------------------------------------------------
    def check(
        self,
        *,
        kind: Kind,
        model_id: str,
        num_layers: int,
        num_experts: int,
        top_k: int,
        input_dim: int | None = None,
        stride: int | None = None,
        source: str = "the predictor",
    ) -> None:
        """Raises ValueError, naming the mismatch and what to do, unless these weights fit the model."""
        m = self.meta
        if self.kind != kind:
            raise ValueError(f"{source} holds {self.kind!r} predictors; the {kind!r} policy needs its own")
        if m.get("model_id") and model_id and m["model_id"] != model_id:
            raise ValueError(
                f"{source} was trained for model {m['model_id']!r} but is used with {model_id!r}; retrain "
                "it on traces of this model (benchmarks/train_predictors.py)"
            )
        want = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
        if input_dim is not None:
            want["input_dim"] = input_dim
        wrong = {name: (m.get(name), value) for name, value in want.items() if m.get(name) != value}
        if wrong:
            detail = ", ".join(f"{name}={have} (model: {need})" for name, (have, need) in wrong.items())
            raise ValueError(
                f"{source} does not fit this model: {detail}; retrain it on traces of this model "
                "(benchmarks/train_predictors.py)"
            )
        if stride is not None and m.get("stride") != stride:
            raise ValueError(
                f"{source} predicts {m.get('stride')} layers ahead but prefetch_distance={stride}; set "
                f"OffloadConfig(prefetch_distance={m.get('stride')}) or retrain with --stride {stride}"
            )

    # -- persistence -------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Writes `path.npz` (arrays) and `path.json` (kind and meta); returns the stem."""
        stem = _stem(path)
        stem.parent.mkdir(parents=True, exist_ok=True)
        arrays = {
            "mean": self.mean,
            "std": self.std,
            "popularity": self.popularity,
            "affinity": self.affinity,
        }
        for i, layer in enumerate(self.layers):
            arrays[f"w{i}"], arrays[f"b{i}"] = layer["w"], layer["b"]
        write_atomically(stem.with_suffix(".npz"), lambda f: np.savez(f, **arrays))
        header = {"format_version": FORMAT_VERSION, "kind": self.kind, "num_mlp_layers": len(self.layers)}
        text = json.dumps({**header, "meta": self.meta}, indent=1).encode()
        write_atomically(stem.with_suffix(".json"), lambda f: f.write(text))
        return stem

    @classmethod
    def load(cls, path: str | os.PathLike) -> Predictor:
        stem = _stem(path)
        try:
            header = json.loads(stem.with_suffix(".json").read_text())
            data = np.load(stem.with_suffix(".npz"))
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"predictor {stem}: missing {err.filename}; train one with benchmarks/train_predictors.py"
            ) from None
        if header.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"predictor {stem}: format_version {header.get('format_version')} is not {FORMAT_VERSION}"
            )
        layers = [{"w": data[f"w{i}"], "b": data[f"b{i}"]} for i in range(header["num_mlp_layers"])]
        return cls(
            header["kind"],
            header["meta"],
            layers,
            data["mean"],
            data["std"],
            data["popularity"],
            data["affinity"],
        )


def _stem(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".npz", ".json") else path


# -- features -------------------------------------------------------------------------------------------
def duoserve_features(
    history: np.ndarray, target: int, popularity: np.ndarray, affinity: np.ndarray
) -> np.ndarray:
    """DuoServe's state s_t = [h_t, p_t, a_{t-1,t}] (section 4.2, eq. 5) for predicting MoE layer `target`.

    Args:
      history: `[N, L, J]` multi-hot experts each token chose in layers < target (zeros from `target` on).
      target: the layer to predict, >= 1.
    Returns:
      `[N, L * J + 2 * J]`: the history flattened, the target layer's popularity, and the affinity vector of
      the previous layer's selection (the mean of the affinity rows of its chosen experts, as the State
      Constructor of section 5.3 builds it).
    """
    n = history.shape[0]
    prev = history[:, target - 1]  # [N, J]
    aff = prev @ affinity[target - 1] / np.maximum(prev.sum(-1, keepdims=True), 1.0)  # [N, J]
    pop = np.broadcast_to(popularity[target], prev.shape)
    return np.concatenate([history.reshape(n, -1), pop, aff], axis=1).astype(np.float32)
