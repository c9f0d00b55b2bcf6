"""Training the small MoE models that ship with fmoe_jax (`fmoe-tiny-mixtral`, `fmoe-tiny-qwen-moe`,
`fmoe-tiny-qwen3-moe`) on CPU.

`benchmarks/train_tiny_moe.py` is the command line; tests train tiny configs for a few steps. The data are
the domain corpora (`workloads.load_corpora`), the model is the project's own Flax model built from an HF
config, the loss is next-token cross-entropy plus the HF load-balancing loss; checkpoints resume exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from fmoe_jax.models import Layout, MoECausalLM, build_model, config_from_hf, init_kv_cache
from fmoe_jax.models.moe import Kernel
from fmoe_jax.research import workloads

VOCAB_SIZE = 8192
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2  # fixed by fmoe_jax.research.tokenizer.SPECIAL_TOKENS

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    # Trained on 256-token windows; longer contexts work but the model has not seen those positions.
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    # Switch Transformer's coefficient: the HF default (0.001) let tiny models collapse onto few experts.
    router_aux_loss_coef=0.01,
    output_router_logits=False,
    initializer_range=0.02,
    attention_dropout=0.0,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

# HF config.json of each shipped model. Sized for this project's 2-core CPU (see DESIGN.md and
# benchmarks/TRAINED_MODELS.md): about 500-1,500 training tokens/s, under 25 MB in bfloat16.
PRESETS: dict[str, dict[str, Any]] = {
    "fmoe-tiny-mixtral": dict(
        _COMMON,
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        intermediate_size=256,
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        sliding_window=None,
        router_jitter_noise=0.0,
    ),
    "fmoe-tiny-qwen-moe": dict(
        _COMMON,
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        intermediate_size=512,  # dense MLP size; unused (every layer is MoE) but required by the config
        moe_intermediate_size=64,
        shared_expert_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=True,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
    ),
    # Many small experts with top-8, as Qwen3-30B-A3B (128 experts of 768 on hidden 2048): 64 experts of
    # 48 (the same 0.375 x hidden), renormalised top-8, per-head q/k norms, no shared expert.
    "fmoe-tiny-qwen3-moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=512,  # dense MLP size; unused (every layer is MoE) but required by the config
        moe_intermediate_size=48,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=False,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
    ),
}


@dataclasses.dataclass(frozen=True, slots=True)
class TrainConfig:
    """Optimisation settings; the schedule is linear warmup then cosine decay to `min_lr_ratio * lr`."""

    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    kernel: Kernel = "blocked"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (BOS plus one token), got {self.seq_len}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")


# ---------------------------------------------------------------------------------------------------------
# Data: token streams per domain, windows that start at line starts, BOS first (as prompts are encoded)
# ---------------------------------------------------------------------------------------------------------


def tokenize_with_line_starts(tokenizer: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `text` (no special tokens) and the indices of tokens that begin a line.

    Byte-level pre-tokenisation never merges a newline with the next character, so every line start is
    also a token start, except after leading spaces (those lines start at their first space token).
    """
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    line_start = np.zeros(len(text) + 1, bool)
    line_start[0] = True
    line_start[np.flatnonzero(np.frombuffer(text.encode("utf-32-le"), np.uint32) == ord("\n")) + 1] = True
    first_char = np.asarray([start for start, _ in encoding.offsets], np.int64)
    return ids, np.flatnonzero(line_start[first_char]).astype(np.int64)


@dataclasses.dataclass
class TokenSampler:
    """Training batches drawn from per-domain token streams, a pure function of (seed, step).

    Each row picks a domain with probability proportional to its token count and a window start among the
    line-start tokens, and is `[BOS] + tokens[start : start + T - 1]`, so a prompt encoded with BOS looks
    like the text the model was trained on.
    """

    tokens: dict[str, np.ndarray]  # domain -> [n] int32
    starts: dict[str, np.ndarray]  # domain -> [m] int64 line-start token indices

    @classmethod
    def from_texts(cls, tokenizer: Any, texts: Mapping[str, str]) -> TokenSampler:
        tokens, starts = {}, {}
        for domain, text in texts.items():
            tokens[domain], starts[domain] = tokenize_with_line_starts(tokenizer, text)
        return cls(tokens, starts)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
        """`[B, T]` int32 token ids of training step `step`."""
        domains = list(self.tokens)
        sizes = np.asarray([len(self.tokens[d]) for d in domains], np.float64)
        rng = np.random.default_rng([seed, step])
        rows = np.empty((batch_size, seq_len), np.int32)
        rows[:, 0] = BOS_ID
        for b, d in enumerate(rng.choice(len(domains), size=batch_size, p=sizes / sizes.sum())):
            tokens = self.tokens[domains[d]]
            starts = self.starts[domains[d]]
            usable = starts[starts <= len(tokens) - (seq_len - 1)]
            if len(usable) == 0:
                raise ValueError(
                    f"domain {domains[d]!r} has {len(tokens)} tokens, fewer than seq_len - 1 = {seq_len - 1}"
                )
            start = usable[rng.integers(len(usable))]
            rows[b, 1:] = tokens[start : start + seq_len - 1]
        return rows


# ---------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------


def load_balancing_loss(probs: list[jax.Array], top_k: int) -> jax.Array:
    """The HF (Switch Transformer) auxiliary loss over all MoE layers pooled, as
    `transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func` without a mask.

    `J * sum_e f_e * P_e`, where f_e is the share of top-k assignments and P_e the mean router probability of
    expert e, both over every token of every layer. Equals `top_k` when routing is uniform.
    """
    all_probs = jnp.concatenate(probs, axis=0)  # [L*N, J]
    num_experts = all_probs.shape[-1]
    _, ids = jax.lax.top_k(all_probs, top_k)
    assigned = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=1)  # [L*N, J]
    return num_experts * jnp.sum(jnp.mean(assigned, axis=0) * jnp.mean(all_probs, axis=0))


def token_nll(model: MoECausalLM, tokens: jax.Array, kernel: Kernel) -> tuple[jax.Array, list[jax.Array]]:
    """Negative log-likelihood `[B, T-1]` of tokens[:, 1:] given their prefixes, and each MoE layer's router
    probabilities `[B*T, J]`. One full-sequence forward with a KV cache of length T."""
    b, t = tokens.shape
    cache = init_kv_cache(model.config, b, t, model.dtype)
    layout = Layout(jnp.int32(0), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), t)
    logits, _, routings = model(tokens, cache, layout, kernel=kernel)  # [B, T, V] float32
    logits = logits[:, :-1]
    target = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target, [r.probs for r in routings]


def _loss(params, graphdef, tokens, kernel, aux_coef, top_k):
    model = nnx.merge(graphdef, params)
    nll, probs = token_nll(model, tokens, kernel)
    ce = jnp.mean(nll)
    aux = load_balancing_loss(probs, top_k)
    return ce + aux_coef * aux, (ce, aux)


@functools.cache  # one object per config, so `train_step` (static in it) compiles once per model shape
def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (no decay on norms and biases) with global-norm clipping, warmup and cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, cfg.steps, end_value=cfg.lr * cfg.min_lr_ratio
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            schedule,
            b1=0.9,
            b2=0.95,
            weight_decay=cfg.weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
        ),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "kernel", "aux_coef", "top_k"))
def train_step(params, opt_state, tokens, *, graphdef, optimizer, kernel, aux_coef, top_k):
    """One AdamW step on tokens `[B, T]`: new params, optimizer state, and (loss, ce, aux, grad norm)."""
    (loss, (ce, aux)), grads = jax.value_and_grad(_loss, has_aux=True)(
        params, graphdef, tokens, kernel, aux_coef, top_k
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, (loss, ce, aux, optax.tree.norm(grads))


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: every leaf of (params, optimizer state) in one .npz, progress in a .json beside it
# ---------------------------------------------------------------------------------------------------------

CHECKPOINT = "checkpoint"


def save_checkpoint(workdir: Path, params, opt_state, meta: dict[str, Any]) -> None:
    """Writes `workdir/checkpoint.npz` and `.json` atomically (a crash leaves the previous pair)."""
    leaves = jax.tree.leaves((params, opt_state))
    tmp = workdir / f"{CHECKPOINT}.tmp.npz"
    np.savez(tmp, **{f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})
    tmp_meta = workdir / f"{CHECKPOINT}.tmp.json"
    tmp_meta.write_text(json.dumps(meta))
    os.replace(tmp, workdir / f"{CHECKPOINT}.npz")
    os.replace(tmp_meta, workdir / f"{CHECKPOINT}.json")


def load_checkpoint(workdir: Path, params, opt_state) -> tuple[Any, Any, dict[str, Any]] | None:
    """(params, opt_state, meta) restored into the structure of the given ones; None without a checkpoint."""
    path, meta_path = workdir / f"{CHECKPOINT}.npz", workdir / f"{CHECKPOINT}.json"
    if not path.exists() or not meta_path.exists():
        return None
    leaves, treedef = jax.tree.flatten((params, opt_state))
    with np.load(path) as data:
        stored = [data[f"leaf_{i:05d}"] for i in range(len(data.files))]
    if len(stored) != len(leaves) or any(s.shape != x.shape for s, x in zip(stored, leaves, strict=True)):
        raise ValueError(
            f"{path} holds {len(stored)} arrays that do not match this model and optimizer ({len(leaves)} "
            "arrays); it was written for another config. Use a fresh --workdir."
        )
    restored = [jnp.asarray(s, x.dtype) for s, x in zip(stored, leaves, strict=True)]
    params, opt_state = jax.tree.unflatten(treedef, restored)
    return params, opt_state, json.loads(meta_path.read_text())


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    module: MoECausalLM
    step: int  # optimizer steps done
    tokens_seen: int
    train_seconds: float  # wall time over all runs of this workdir, compilation included
    history: list[dict[str, float]]  # per step: loss, ce, aux, grad_norm, seconds
    finished: bool  # all `cfg.steps` done (False when the time budget ran out first)


def train(
    hf_config: Mapping[str, Any],
    sampler: TokenSampler,
    cfg: TrainConfig,
    workdir: str | os.PathLike,
    *,
    minutes: float | None = None,
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Trains (or resumes) a model of `hf_config` in `workdir`, checkpointing every `cfg.checkpoint_every`.

    Args:
      hf_config: the HF config.json dict of the model (e.g. `PRESETS[name]`); `router_aux_loss_coef` weighs
        the load-balancing loss.
      sampler: the training batches.
      cfg: optimisation settings. A resumed run must use the same ones (checked).
      workdir: where `checkpoint.npz/.json` live; created if missing.
      minutes: wall-time budget of this call (compilation included); on expiry it checkpoints and returns.
      stop_after: return after this many steps in total (tests use it to interrupt a run).
      progress: show a tqdm bar with loss and tokens/s.
    """
    from tqdm.auto import tqdm

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_cfg = config_from_hf(dict(hf_config))
    module = build_model(model_cfg, dtype=jnp.float32, seed=cfg.seed)
    graphdef, params = nnx.split(module)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(params)
    run = dict(hf_config=dict(hf_config), train_config=dataclasses.asdict(cfg))
    meta: dict[str, Any] = dict(run, step=0, train_seconds=0.0, history=[])
    restored = load_checkpoint(workdir, params, opt_state)
    if restored is not None:
        params, opt_state, meta = restored
        previous = {k: meta[k] for k in run}
        if json.loads(json.dumps(run)) != previous:
            raise ValueError(
                f"{workdir} holds a run with other settings ({previous}); resume with the same preset and "
                "options or use a fresh --workdir."
            )

    step_fn = functools.partial(
        train_step,
        graphdef=graphdef,
        optimizer=optimizer,
        kernel=cfg.kernel,
        aux_coef=float(hf_config.get("router_aux_loss_coef", 0.0)),
        top_k=model_cfg.top_k,
    )
    last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    start = time.monotonic()
    seconds_before = meta["train_seconds"]
    bar = tqdm(total=cfg.steps, initial=meta["step"], disable=not progress, unit="step", smoothing=0.1)
    while meta["step"] < last:
        if minutes is not None and time.monotonic() - start > minutes * 60:
            break
        t0 = time.monotonic()
        tokens = jnp.asarray(sampler.batch(cfg.seed, meta["step"], cfg.batch_size, cfg.seq_len))
        params, opt_state, stats = step_fn(params, opt_state, tokens)
        loss, ce, aux, grad_norm = (float(x) for x in stats)
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss became {loss} at step {meta['step']}; lower --lr or check the data"
            )
        seconds = time.monotonic() - t0
        meta["step"] += 1
        meta["history"].append(dict(loss=loss, ce=ce, aux=aux, grad_norm=grad_norm, seconds=seconds))
        meta["train_seconds"] = seconds_before + time.monotonic() - start
        bar.set_postfix(
            loss=f"{loss:.3f}",
            ce=f"{ce:.3f}",
            aux=f"{aux:.3f}",
            tok_s=f"{tokens_per_step / seconds:.0f}",
            refresh=False,
        )
        bar.update(1)
        if meta["step"] % cfg.checkpoint_every == 0:
            save_checkpoint(workdir, params, opt_state, meta)
    bar.close()
    meta["train_seconds"] = seconds_before + time.monotonic() - start
    save_checkpoint(workdir, params, opt_state, meta)
    return TrainResult(
        module=nnx.merge(graphdef, params),
        step=meta["step"],
        tokens_seen=meta["step"] * tokens_per_step,
        train_seconds=meta["train_seconds"],
        history=meta["history"],
        finished=meta["step"] >= cfg.steps,
    )


# ---------------------------------------------------------------------------------------------------------
# Tokenizer and evaluation
# ---------------------------------------------------------------------------------------------------------


def prepare_tokenizer(
    corpora_dir: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int = VOCAB_SIZE
):
    """Trains the byte-level BPE on the train split of every domain (once; reused if `out_dir` has one) and
    makes it prepend `<s>` to every encoded text, as training rows start. Returns the loaded tokenizer."""
    import transformers
    from fmoe_jax.research.tokenizer import (
        BOS_TOKEN,
        CHAT_TEMPLATE,
        EOS_TOKEN,
        PAD_TOKEN,
        UNK_TOKEN,
        load_tokenizer,
        train_bpe_tokenizer,
    )
    from tokenizers import processors

    out_dir = Path(out_dir)
    if not (out_dir / "tokenizer.json").exists():
        texts = workloads.load_corpora(corpora_dir, "train")
        train_bpe_tokenizer(
            [line for text in texts.values() for line in text.splitlines(True)], vocab_size, out_dir
        )
        backend = load_tokenizer(out_dir).backend_tokenizer
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, BOS_ID)],
        )
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=BOS_TOKEN,
            eos_token=EOS_TOKEN,
            pad_token=PAD_TOKEN,
            unk_token=UNK_TOKEN,
            clean_up_tokenization_spaces=False,
            chat_template=CHAT_TEMPLATE,
        ).save_pretrained(str(out_dir))
    tokenizer = load_tokenizer(out_dir)
    if tokenizer("a")["input_ids"][:1] != [BOS_ID] or len(tokenizer) != vocab_size:
        raise ValueError(
            f"{out_dir}: the tokenizer there does not prepend <s> (id {BOS_ID}) or has vocabulary "
            f"{len(tokenizer)}, not {vocab_size}; delete it to train a new one."
        )
    return tokenizer


def held_out_nll(
    logits_fn: Callable[[np.ndarray], Any],
    tokenizer: Any,
    texts: Mapping[str, str],
    seq_len: int = 256,
    batch_size: int = 8,
    max_windows: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Mean next-token NLL (nats) of each domain's text, in consecutive windows `[BOS] + T-1 tokens`.

    `logits_fn(tokens [B, T]) -> logits [B, T, V]` (e.g. `lambda t: fmoe_jax.forward(model, t)`). A tail
    shorter than a window is left out. Returns, per domain, `nll`, `tokens` (predicted tokens) and `targets`
    (their ids, `[n]`, for baselines on the same tokens).
    """
    out = {}
    for domain, text in texts.items():
        ids = np.asarray(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
        n_windows = len(ids) // (seq_len - 1)
        if max_windows is not None:
            n_windows = min(n_windows, max_windows)
        if n_windows == 0:
            raise ValueError(f"held-out text of {domain!r} has {len(ids)} tokens, fewer than one window")
        windows = ids[: n_windows * (seq_len - 1)].reshape(n_windows, seq_len - 1)
        rows = np.concatenate([np.full((n_windows, 1), BOS_ID, np.int32), windows], axis=1)
        total = 0.0
        for i in range(0, n_windows, batch_size):
            chunk = rows[i : i + batch_size]
            pad = batch_size - len(chunk)  # a fixed batch keeps one compiled shape
            batch = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)]) if pad else chunk
            logits = np.asarray(logits_fn(batch), np.float32)[: len(chunk), :-1]
            peak = logits.max(axis=-1)
            lse = peak + np.log(np.sum(np.exp(logits - peak[..., None]), axis=-1))
            total += float(np.sum(lse - np.take_along_axis(logits, chunk[:, 1:, None], -1)[..., 0]))
        out[domain] = dict(nll=total / windows.size, tokens=int(windows.size), targets=windows.reshape(-1))
    return out


def unigram_nll(train_ids: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Mean NLL (nats) of `targets` under the add-one smoothed unigram distribution of `train_ids`."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-np.mean(log_p[targets]))
