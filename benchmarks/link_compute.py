"""What the accelerator's link and decode compute really do: the numbers behind the simulator's presets.

    python -m benchmarks.link_compute [--models mixtral,qwen2_moe,phimoe,qwen3_moe,olmoe] [--repeats 15]

Measured on JAX's default device (a GPU where one is at hand; on the CPU the "link" is a memcpy and the
rates say nothing about a PCIe link, but every step runs):

1. copies: one expert from `pinned_host` memory to the device, bench-s's (float32, as its checkpoint
   ships) and each model preset's (bfloat16): whole (one `device_put` of its three matrices), whole by a
   compiled copy program (`offload/transfer.py`'s `copier`: `PROGRAM_COPIES` lists the platforms where it
   beats `device_put`), per matrix
   (each landed before the next is issued: `ChunkedJaxMover`'s order) and in quarter-matrix chunks
   joined on the device. Achieved rate over the link's nominal rate is the preset's `link_efficiency`.
2. an on-demand load issued behind two prefetches of the same size: its latency with `JaxMover` (the
   runtime orders copies: it waits for both) and with `ChunkedJaxMover` (it waits for one matrix at most).
3. overlap: a decode-sized compute loop alone, a copy alone, and both issued together.
4. one decoder layer of each model preset at batch 1, bfloat16, a KV cache of `--context` tokens: the
   attention block and the routed (top-k, plus shared) experts, each timed as one call (what a per-layer
   engine pays, dispatch included) and inside one program over 8 layers (kernels only; 8 distinct weight
   sets so that no layer reads another's from cache). The cost model's roofline bytes over the kernel
   time, over the nominal HBM rate, is the preset's `hbm_efficiency`.

Results: `results/link_compute.{json,md}`. The GPU run that set the presets' efficiencies is recorded in
`offload/cost_model.py` beside them.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, median_ms, print_table, save, save_png

BENCH_S = dict(hidden_size=1024, expert_intermediate_size=3584)  # fmoe_jax.testing.PRESETS["bench-s"]


def nominal(device_kind: str):
    """The hardware preset whose datasheet numbers describe this device, or None (CPU, unknown GPU)."""
    from fmoe_jax.offload.cost_model import HARDWARE

    kind = device_kind.lower()
    for key, name in (("h200", "h200_sxm"), ("h100 pcie", "h100_pcie"), ("h100", "h100_sxm")):
        if key in kind:
            return HARDWARE[name]
    for key, name in (("a100", "a100_sxm"), ("3090", "rtx_3090")):
        if key in kind:
            return HARDWARE[name]
    return None


def pcie_link() -> str | None:
    """The GPU's current PCIe generation and width, as nvidia-smi reports them."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def timed(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` (which blocks until its work is done)."""
    return median_ms(fn, repeats, warmup) / 1e3


def random_matrix(key, shape, dtype, sharding):
    import jax
    import jax.numpy as jnp

    return jax.device_put((0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype), sharding)


# -- 1. copies ---------------------------------------------------------------------------------------------
def measure_copies(name, d, f, dtype, shardings, repeats, link_nominal):
    import jax
    import jax.numpy as jnp
    from fmoe_jax.offload.transfer import copier

    pinned, device = shardings
    keys = jax.random.split(jax.random.key(hash(name) % 2**31), 3)
    host = [random_matrix(k, s, dtype, pinned) for k, s in zip(keys, [(f, d), (f, d), (d, f)], strict=True)]
    quarters = [[jax.device_put(part, pinned) for part in np.split(np.asarray(m), 4)] for m in host]
    join = jax.jit(lambda parts: [jnp.concatenate(p, axis=0) for p in parts])
    nbytes = sum(m.nbytes for m in host)

    def whole():
        jax.block_until_ready(jax.device_put(host, device))

    by_program = copier(device, by_program=True)

    def whole_program():
        jax.block_until_ready(by_program(host))

    def per_matrix():
        for m in host:
            jax.block_until_ready(jax.device_put(m, device))

    def chunked_joined():
        jax.block_until_ready(join(jax.device_put(quarters, device)))

    row = dict(expert=name, dtype=str(jnp.dtype(dtype)), mb=nbytes / 1e6)
    whole_program()  # compiles
    labelled = ("whole", whole), ("whole_program", whole_program), ("per_matrix", per_matrix)
    for label, fn in (*labelled, ("quarters_joined", chunked_joined)):
        seconds = timed(fn, repeats)
        row[f"{label}_ms"] = seconds * 1e3
        row[f"{label}_gbs"] = nbytes / seconds / 1e9
    row["one_matrix_ms"] = row["per_matrix_ms"] / 3
    if link_nominal:
        row["link_efficiency"] = row["whole_gbs"] * 1e9 / link_nominal
    return row, host


# -- 2. an on-demand load behind prefetches -----------------------------------------------------------------
def measure_urgent(host, device, repeats):
    from fmoe_jax.models.moe import ExpertWeights
    from fmoe_jax.offload.transfer import ChunkedJaxMover, JaxMover

    expert = ExpertWeights(*host)
    experts = {k: expert for k in range(3)}
    out = {}
    for label, mover in (
        ("JaxMover", JaxMover(experts.__getitem__, device)),
        ("ChunkedJaxMover", ChunkedJaxMover(experts.__getitem__, device)),
    ):
        alone, behind = [], []
        for i in range(repeats + 1):
            start = time.perf_counter()
            mover.wait([mover.start(2, urgent=True)])
            alone.append(time.perf_counter() - start)
            prefetches = [mover.start(0), mover.start(1)]
            start = time.perf_counter()
            mover.wait([mover.start(2, urgent=True)])
            behind.append(time.perf_counter() - start)
            mover.wait(prefetches)
            if i == 0:  # warm-up
                alone, behind = [], []
        if hasattr(mover, "close"):
            mover.close()
        out[label] = dict(
            alone_ms=float(np.median(alone) * 1e3), behind_two_ms=float(np.median(behind) * 1e3)
        )
    return out


# -- 3. overlap of copies and compute ----------------------------------------------------------------------
def measure_overlap(host, device, copy_ms, repeats, width: int = 8192):
    """A loop of GEMVs sized to take about as long as one expert's copy, alone and beside the copy, for each
    way of issuing the copy: `overlap` is the share of the shorter of the two hidden behind the other."""
    import concurrent.futures

    import jax
    import jax.numpy as jnp

    w = random_matrix(jax.random.key(7), (width, width), jnp.bfloat16, device)
    x0 = jnp.ones((1, width), jnp.bfloat16)
    numpy_host = [np.asarray(m) for m in host]  # pageable host memory

    def make(steps):
        @jax.jit
        def loop(x):
            return jax.lax.fori_loop(0, steps, lambda _, x: jnp.tanh(x @ w), x)

        return loop

    probe = make(16)
    per_step = timed(lambda: jax.block_until_ready(probe(x0)), 5) / 16
    steps = int(np.clip(copy_ms / 1e3 / max(per_step, 1e-7), 4, 4096))
    loop = make(steps)

    @jax.jit
    def loop_and_copy(x, experts):  # one program: the copy is XLA's to schedule beside the loop
        return loop(x), jax.device_put(experts, device)

    pool = concurrent.futures.ThreadPoolExecutor(1)

    def copy_beside(compute):  # the copy issued from another thread (as `ChunkedJaxMover` does), then compute
        copied = pool.submit(lambda: jax.block_until_ready(jax.device_put(host, device)))
        jax.block_until_ready(compute())
        copied.result()

    compute_s = timed(lambda: jax.block_until_ready(loop(x0)), repeats)
    variants = {
        "pinned, after compute": (
            lambda: jax.device_put(host, device),
            lambda: jax.block_until_ready((loop(x0), jax.device_put(host, device))),
        ),
        "pinned, before compute": (
            lambda: jax.device_put(host, device),
            lambda: jax.block_until_ready(jax.device_put(host, device) + [loop(x0)]),
        ),
        "numpy, after compute": (
            lambda: jax.device_put(numpy_host, device),
            lambda: jax.block_until_ready((loop(x0), jax.device_put(numpy_host, device))),
        ),
        "pinned, other thread": (
            lambda: jax.device_put(host, device),
            lambda: copy_beside(lambda: loop(x0)),
        ),
        "pinned, one program": (
            lambda: jax.device_put(host, device),
            lambda: jax.block_until_ready(loop_and_copy(x0, host)),
        ),
    }
    rows = []
    for label, (copy, both) in variants.items():
        try:
            copy_s = timed(lambda copy=copy: jax.block_until_ready(copy()), repeats)
            both_s = timed(both, repeats)
        except Exception as err:  # noqa: BLE001 - a way this runtime cannot issue a copy
            rows.append(dict(issue=label, error=f"{type(err).__name__}: {err}"[:200]))
            continue
        hidden = (compute_s + copy_s - both_s) / min(compute_s, copy_s)
        rows.append(
            dict(
                issue=label,
                compute_ms=compute_s * 1e3,
                copy_ms=copy_s * 1e3,
                both_ms=both_s * 1e3,
                overlap=float(np.clip(hidden, 0.0, 1.0)),
            )
        )
    pool.shutdown()
    return rows


def measure_control_flow(repeats: int, count: int = 48, width: int = 1024, branches: int = 33) -> dict:
    """What one conditional costs inside a jitted program on this device: `count` small matrix-vector
    products in sequence, each plain, inside a `lax.cond`, inside a `lax.switch` over `branches` (gpt-oss's
    32 experts and a skip: the decode kernel's one switch per assignment), and as a `fori_loop` of one
    iteration; the difference over `count` is each one's price. A GPU runtime reads a conditional's branch
    index on the host, which stalls the device; the offload step holds about three per MoE layer."""
    import jax
    import jax.numpy as jnp

    w = jax.random.normal(jax.random.key(0), (width, width), jnp.float32) / width**0.5
    scales = [1.0 + s / 64 for s in range(branches)]
    x = jnp.ones((1, width), jnp.float32)
    index = jnp.asarray([i % branches for i in range(count)], jnp.int32)  # every branch taken, none constant

    def plain(x, w, index):
        for i in range(count):
            x = jnp.tanh(x @ w) * scales[i % branches]
        return x

    def cond(x, w, index):
        for i in range(count):
            x = jax.lax.cond(
                index[i] >= 0, lambda v, i=i: jnp.tanh(v @ w) * scales[i % branches], lambda v: v, x
            )
        return x

    def switch(x, w, index):
        cases = [lambda v, s=s: jnp.tanh(v @ w) * s for s in scales]
        for i in range(count):
            x = jax.lax.switch(index[i], cases, x)
        return x

    def loop(x, w, index):
        for i in range(count):
            x = jax.lax.fori_loop(
                0, index[i] * 0 + 1, lambda _, v, i=i: jnp.tanh(v @ w) * scales[i % branches], x
            )
        return x

    ms = {}
    for name, fn in (("plain", plain), ("cond", cond), ("switch", switch), ("loop", loop)):
        program = jax.jit(fn)
        ms[name] = median_ms(lambda p=program: p(x, w, index).block_until_ready(), repeats, warmup=2)
    each = {name: (ms[name] - ms["plain"]) / count * 1e3 for name in ("cond", "switch", "loop")}
    return dict(
        count=count, width=width, branches=branches, program_ms=ms, us_each=each, dispatch=_dispatch(repeats)
    )


def _dispatch(repeats: int, counts: tuple[int, ...] = (1, 256, 2048)) -> dict:
    """A launch's price by its number of array arguments (the offload engine passes every cached expert's
    matrices, and their scales, one by one: thousands at gpt-oss-20b's size): the median call of a program
    that adds the first of `count` small arrays to a scalar, and the slope per argument."""
    import jax
    import jax.numpy as jnp

    ms = {}
    for count in counts:
        arrays = [jnp.full((16,), i, jnp.float32) for i in range(count)]
        program = jax.jit(lambda xs: xs[0] + 1.0)
        ms[count] = median_ms(lambda p=program, a=arrays: p(a).block_until_ready(), repeats, warmup=2)
    slope = (ms[counts[-1]] - ms[counts[0]]) / (counts[-1] - counts[0]) * 1e3
    return dict(call_ms={str(k): v for k, v in ms.items()}, us_per_argument=slope)


def measure_expert_select(
    repeats: int, d: int, f: int, experts: int = 32, top_k: int = 4, layers: int = 8
) -> dict:
    """A batch-1 decode token's routed experts over `layers` MoE layers (bfloat16, SwiGLU), reached two ways:
    the engine's kernel (`expert_parts(kernel="unrolled")`: per assignment, a `lax.switch` over the layer's
    expert arrays, passed one by one as the offload engine passes its cached experts) and a stacked pool per
    layer (`[J, F, D]` arrays; each chosen expert read at a dynamic index, with no conditional, through the
    same `swiglu`). Returns milliseconds per layer of each, one program per way over all the layers, compiled
    as the engine compiles, their compile times, and the largest difference between their outputs: 0 where
    the pool is lossless."""
    import jax
    import jax.numpy as jnp
    from fmoe_jax.models.moe import ExpertWeights, Routing, expert_parts, swiglu

    from fmoe_jax.engines.programs import EXACT_ROUNDING

    keys = iter(jax.random.split(jax.random.key(1), 3 * layers))
    pools = [
        tuple(
            (jax.random.normal(next(keys), (experts, *shape), jnp.float32) / shape[1] ** 0.5).astype(
                jnp.bfloat16
            )
            for shape in ((f, d), (f, d), (d, f))
        )
        for _ in range(layers)
    ]
    split = [[ExpertWeights(g[e], u[e], w[e]) for e in range(experts)] for g, u, w in pools]
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)]), jnp.int32)
    weights = jnp.full((layers, top_k), 1.0 / top_k, jnp.float32)
    x = jnp.ones((1, d), jnp.bfloat16)

    def switched(x, split, ids, weights):
        slots, valid = jnp.arange(experts, dtype=jnp.int32), jnp.ones((1,), bool)
        for layer, layer_experts in enumerate(split):
            probs = jnp.zeros((1, experts), jnp.float32)
            routing = Routing(probs, ids[layer][None], weights[layer][None])
            parts = expert_parts(x, routing, layer_experts, slots, valid, kernel="unrolled")
            x = jnp.sum(parts, axis=1).astype(x.dtype)
        return x

    def pooled(x, pools, ids, weights):  # the engine's expert (`swiglu`) on weights read at a dynamic index
        for layer, pool in enumerate(pools):
            parts = []
            for a in range(top_k):
                w = ExpertWeights(
                    *(jax.lax.dynamic_index_in_dim(m, ids[layer, a], keepdims=False) for m in pool)
                )
                parts.append(swiglu(x, w).astype(jnp.float32) * weights[layer, a])
            x = jnp.sum(jnp.stack(parts, axis=1), axis=1).astype(x.dtype)
        return x

    ms, outs, compile_s = {}, {}, {}
    for name, fn, weights_in in (("switch", switched, split), ("pool", pooled, pools)):
        start = time.perf_counter()
        lowered = jax.jit(fn).lower(x, weights_in, ids, weights)
        program = lowered.compile(compiler_options=EXACT_ROUNDING)  # as the engine compiles
        compile_s[name] = time.perf_counter() - start
        outs[name] = np.asarray(program(x, weights_in, ids, weights), np.float32)
        ms[name] = median_ms(
            lambda p=program, w=weights_in: p(x, w, ids, weights).block_until_ready(), repeats, warmup=2
        )
    return dict(
        d=d,
        f=f,
        experts=experts,
        top_k=top_k,
        layers=layers,
        ms_per_layer={k: v / layers for k, v in ms.items()},
        compile_s=compile_s,
        max_abs_difference=float(np.max(np.abs(outs["switch"] - outs["pool"]))),  # 0: bit-identical
    )


def measure_latency(pinned, device, repeats, link_nominal, sizes_mb=(0.25, 1, 4, 16, 64, 256)):
    """One bf16 array from pinned host memory to the device at sizes from 256 KB to 256 MB: a least-squares
    line through (bytes, seconds) gives the link's fixed cost per copy and its streaming rate."""
    import jax
    import jax.numpy as jnp

    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20 / 2)
        src = random_matrix(jax.random.key(int(mb * 4)), (n,), jnp.bfloat16, pinned)
        seconds = timed(lambda src=src: jax.block_until_ready(jax.device_put(src, device)), repeats)
        rows.append(dict(mb=n * 2 / 1e6, ms=seconds * 1e3, gbs=n * 2 / seconds / 1e9))
    fit = fit_link([r["mb"] * 1e6 for r in rows], [r["ms"] / 1e3 for r in rows])
    if link_nominal:
        fit["link_efficiency"] = float(fit["rate_gbs"] * 1e9 / link_nominal)
    return dict(sizes=rows, fit=fit)


def fit_link(nbytes, seconds) -> dict:
    """`seconds = latency + bytes / rate` by least squares, with a latency >= 0 and a rate > 0.

    A negative intercept refits the line through the origin. When noise swamps the sizes' differences (small
    copies on a CPU, where a copy is a memcpy), the slope comes out <= 0 and the rate is not resolved: the fit
    then gives the largest copy's bytes over its whole time (a lower bound on the rate), the smallest copy's
    time as the latency (an upper bound), and says `resolved: False`."""
    size, secs = np.asarray(nbytes, float), np.asarray(seconds, float)
    slope, intercept = np.polyfit(size, secs, 1)
    resolved = bool(slope > 0)
    if not resolved:
        big = int(np.argmax(size))
        slope, intercept = secs[big] / size[big], float(secs.min())
    elif intercept < 0:
        slope, intercept = float(size @ secs / (size @ size)), 0.0
    return dict(latency_ms=float(intercept * 1e3), rate_gbs=float(1 / slope / 1e9), resolved=resolved)


# -- 4. one decoder layer at real size ---------------------------------------------------------------------
def measure_layer(preset, context, repeats, device, hardware):
    """Attention (with router) and routed experts of `preset` at batch 1, against the cost model."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from fmoe_jax.offload.cost_model import CostModel

    m = preset
    d, f, k = m.hidden_size, m.expert_intermediate_size, m.top_k
    h, kv, hd = m.num_heads, m.num_kv_heads, m.head_dim
    bf = jnp.bfloat16
    layers = 8
    key = iter(jax.random.split(jax.random.key(1), 64))

    def mat(*shape):
        return random_matrix(next(key), (layers, *shape), bf, device)

    attn = dict(
        wq=mat(d, h * hd),
        wk=mat(d, kv * hd),
        wv=mat(d, kv * hd),
        wo=mat(h * hd, d),
        router=mat(d, m.num_experts),
        kc=mat(context, kv, hd),
        vc=mat(context, kv, hd),
    )
    experts = [dict(gate=mat(d, f), up=mat(d, f), down=mat(f, d)) for _ in range(k)]
    if m.shared_expert_intermediate_size:
        s = m.shared_expert_intermediate_size
        experts.append(dict(gate=mat(d, s), up=mat(d, s), down=mat(s, d)))

    def rms(x):
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)).astype(bf)

    def attention(x, p, i):
        y = rms(x)
        q = (y @ p["wq"][i]).reshape(kv, h // kv, hd)
        kc, vc = p["kc"][i], p["vc"][i]  # [S, KV, hd]
        scores = jnp.einsum("kgd,skd->kgs", q, kc).astype(jnp.float32) / np.sqrt(hd)
        o = jnp.einsum("kgs,skd->kgd", jax.nn.softmax(scores, -1).astype(bf), vc).reshape(1, h * hd)
        x = x + o @ p["wo"][i]
        return x, rms(x) @ p["router"][i]

    def ffn(x, ps, i):
        y, out = rms(x), x
        for p in ps:
            out = out + (jax.nn.silu(y @ p["gate"][i]) * (y @ p["up"][i])) @ p["down"][i]
        return out

    one_attention = jax.jit(lambda x, p: attention(x, p, 0))
    one_ffn = jax.jit(lambda x, ps: ffn(x, ps, 0))

    @jax.jit
    def eight_attention(x, p):
        for i in range(layers):
            x, logits = attention(x, p, i)
            x = x + 1e-3 * logits.sum()
        return x

    @jax.jit
    def eight_ffn(x, ps):
        for i in range(layers):
            x = ffn(x, ps, i)
        return x

    x = random_matrix(next(key), (1, d), bf, device)
    row = dict(model=m.name, context=context)
    row["attention_call_ms"] = timed(lambda: jax.block_until_ready(one_attention(x, attn)), repeats) * 1e3
    row["experts_call_ms"] = timed(lambda: jax.block_until_ready(one_ffn(x, experts)), repeats) * 1e3
    row["attention_kernel_ms"] = (
        timed(lambda: jax.block_until_ready(eight_attention(x, attn)), repeats) * 1e3 / layers
    )
    row["experts_kernel_ms"] = (
        timed(lambda: jax.block_until_ready(eight_ffn(x, experts)), repeats) * 1e3 / layers
    )
    if hardware is not None:
        ideal = dataclasses.replace(hardware, hbm_efficiency=1.0, flops_efficiency=1.0)
        cost = CostModel(m, ideal, m.num_experts)
        row["attention_roofline_ms"] = cost.attention_s(np.array([1]), np.array([context])) * 1e3
        row["experts_roofline_ms"] = (cost.experts_s([1] * k) + cost.shared_s(1)) * 1e3
        for part in ("attention", "experts"):
            row[f"{part}_hbm_fraction"] = row[f"{part}_roofline_ms"] / row[f"{part}_kernel_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--models",
        default="mixtral,qwen2_moe,phimoe,qwen3_moe,olmoe",
        help="model presets (offload/cost_model.py MODELS keys) whose experts and layers are measured",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per measurement (median)")
    parser.add_argument("--context", type=int, default=512, help="KV-cache tokens of the decoder layer")
    parser.add_argument("--small", action="store_true", help="bench-s and Qwen sizes only (a CPU check)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and markdown")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from fmoe_jax.offload.cost_model import MODELS

    dev = jax.devices()[0]
    hardware = nominal(dev.device_kind)
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    models = [MODELS[name] for name in args.models.split(",") if name]
    if args.small:
        models = [m for m in models if m.expert_params < 2e7]
    payload = dict(
        device_kind=dev.device_kind,
        pcie=pcie_link(),
        nominal_preset=None if hardware is None else hardware.name,
        copies=[],
        urgent={},
        overlap={},
        layers=[],
        errors={},
    )

    def section(name, fn):  # a failing section is reported, the others still run
        print(f"-- {name}", flush=True)
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - recorded in the results
            payload["errors"][name] = f"{type(err).__name__}: {err}"
            print(f"   failed: {payload['errors'][name]}", flush=True)
            return None

    link = None if hardware is None else hardware.link_bytes_per_s
    sizes = [("bench-s", BENCH_S["hidden_size"], BENCH_S["expert_intermediate_size"], jnp.float32)]
    sizes += [(m.name, m.hidden_size, m.expert_intermediate_size, jnp.bfloat16) for m in models]
    hosts = {}  # expert name -> its pinned host arrays, for the bench-s and the largest expert
    for name, d, f, dtype in sizes:
        result = section(
            f"copy {name}",
            lambda name=name, d=d, f=f, dtype=dtype: measure_copies(
                name, d, f, dtype, (pinned, device), args.repeats, link
            ),
        )
        if result:
            payload["copies"].append(result[0])
            largest = max(payload["copies"], key=lambda r: r["mb"])["expert"]
            hosts = {k: v for k, v in {**hosts, name: result[1]}.items() if k in ("bench-s", largest)}
            save("link_compute", payload, args.out)
    for name, host in hosts.items():
        payload["urgent"][name] = section(
            f"urgent {name}", lambda host=host: measure_urgent(host, device, args.repeats)
        )
    if payload["copies"]:
        big = max(payload["copies"], key=lambda r: r["mb"])
        payload["overlap_expert"] = big["expert"]
        payload["overlap"] = (
            section(
                "overlap",
                lambda: measure_overlap(hosts[big["expert"]], device, big["whole_ms"], args.repeats),
            )
            or []
        )
    payload["latency"] = section("latency", lambda: measure_latency(pinned, device, args.repeats, link)) or {}
    save("link_compute", payload, args.out)
    for m in models:
        row = section(
            f"layer {m.name}", lambda m=m: measure_layer(m, args.context, args.repeats, device, hardware)
        )
        if row:
            payload["layers"].append(row)
            save("link_compute", payload, args.out)

    print_table(payload["copies"])
    for name, movers in payload["urgent"].items():
        print(f"{name}: {movers}")
    print_table(payload["overlap"])
    print(f"latency: {payload['latency'].get('fit')}")
    print_table(payload["layers"])
    write_markdown(payload, args.out)
    plot(payload, Path(args.out) / "link_compute.png")


def plot(payload: dict, path: Path) -> None:
    """Copy time against size (the fitted line: the fixed cost plus the streaming rate; each expert whole
    and one matrix at a time) and each way of issuing a copy beside compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = payload.get("latency", {}).get("sizes", [])
    if sizes:
        mb = np.array([r["mb"] for r in sizes])
        left.loglog(mb, [r["ms"] for r in sizes], "o", color="tab:grey", label="one array")
        fit = payload["latency"]["fit"]
        line = np.geomspace(mb.min(), mb.max() * 2, 50)
        left.loglog(
            line,
            fit["latency_ms"] + line / fit["rate_gbs"],
            "--",
            color="tab:grey",
            label=f"{fit['latency_ms']:.2f} ms + size / {fit['rate_gbs']:.1f} GB/s",
        )
    copies = payload.get("copies", [])
    if copies:
        left.loglog([r["mb"] for r in copies], [r["whole_ms"] for r in copies], "s", label="an expert, whole")
        left.loglog(
            [r["mb"] for r in copies],
            [r["per_matrix_ms"] for r in copies],
            "^",
            label="an expert, per matrix",
        )
    left.set_xlabel("MB copied")
    left.set_ylabel("ms")
    left.set_title("pinned_host -> device copies")
    left.legend(fontsize=8)
    rows = [r for r in payload.get("overlap", []) if "both_ms" in r]
    if rows:
        x = np.arange(len(rows))
        for i, (key, label) in enumerate((("compute_ms", "compute alone"), ("copy_ms", "copy alone"))):
            right.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
        bars = right.bar(x + 0.27, [r["both_ms"] for r in rows], 0.27, label="both")
        right.bar_label(bars, labels=[f"{r['overlap']:.0%}" for r in rows], fontsize=8)
        right.set_xticks(x, [r["issue"].replace(", ", "\n") for r in rows], fontsize=8)
        right.set_ylabel("ms")
        right.set_title(f"copy beside compute ({payload.get('overlap_expert')}): share hidden")
        right.legend(fontsize=8)
    fig.suptitle(f"live, {payload['device_kind']}: the link and the decode kernels")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


def write_markdown(payload: dict, out: Path) -> None:
    from benchmarks.common import machine

    lines = [
        "# Link and decode compute, measured",
        "",
        "Command: `.venv/bin/python -m benchmarks.link_compute`  ",
        f"Device: {payload['device_kind']} (PCIe gen current, max, width: {payload['pcie']}); "
        f"nominal rates from the `{payload['nominal_preset']}` preset  ",
        f"Machine: {machine()['platform']}, jax {machine()['jax']}",
        "",
    ]

    def table(rows):
        if not rows:
            return ["(none)", ""]
        cols = list(rows[0])
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
        return [
            "| " + " | ".join(cols) + " |",
            "|" + "---|" * len(cols),
            *("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows),
            "",
        ]

    lines += ["### pinned_host -> device copies of one expert", "", *table(payload["copies"])]
    lines += ["### an on-demand load behind two prefetches of the same expert size", ""]
    lines += table(
        [dict(expert=e, mover=k, **v) for e, m in payload["urgent"].items() for k, v in (m or {}).items()]
    )
    lines += [f"### copy / compute overlap ({payload.get('overlap_expert')})", ""]
    lines += table(payload["overlap"])
    lines += [
        "### one bf16 array, pinned_host -> device, by size",
        "",
        *table(payload["latency"].get("sizes", [])),
    ]
    lines += [f"Least-squares fit: {payload['latency'].get('fit')}", ""]
    lines += ["### one decoder layer at batch 1 (bfloat16)", "", *table(payload["layers"])]
    if payload["errors"]:
        lines += ["### sections that failed", "", *(f"- {k}: {v}" for k, v in payload["errors"].items()), ""]
    path = Path(out) / "link_compute.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
