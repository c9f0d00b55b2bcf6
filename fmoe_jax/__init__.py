"""fmoe_jax: serve Mixture-of-Experts language models in JAX with experts offloaded to host memory.

Public API (see README):
    model = fmoe_jax.load_model(path_or_name, offload=None | fmoe_jax.OffloadConfig(...))
    out = fmoe_jax.generate(model, prompts, max_new_tokens=32, sampling=fmoe_jax.Greedy(), seed=0)
    out = fmoe_jax.generate(model, "Hello", do_sample=True, temperature=0.7, top_p=0.9)   # HF names
    for piece in fmoe_jax.generate_stream(model, [{"role": "user", "content": "Hi"}]): ...
    logits = fmoe_jax.forward(model, token_ids)
"""

import os


def _exact_rounding() -> None:
    """Asks XLA to round every bfloat16 intermediate as the program is written (`XLA_FLAGS`
    `--xla_allow_excess_precision=false`), unless the user has set that flag.

    Why: with excess precision allowed (XLA's default), a fusion may keep an intermediate in float32 that
    the program rounds to bfloat16, so the same layer rounds differently inside the resident engine's
    whole-model program and inside the offload engine's per-layer programs. On the shipped trained models
    that flipped greedy tokens (and expert choices) between a full and a partial expert cache. With the
    flag both paths are bit-identical, which is what "offloading is lossless" means here; decode speed
    was unchanged in our measurements. Effective only if set before JAX starts its backend (the first
    computation), which importing fmoe_jax first ensures.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_allow_excess_precision=false".strip()


_exact_rounding()

from fmoe_jax.offload.config import OffloadConfig  # noqa: E402

from .generation import GenerateOutput, GenerationStats, forward, generate, generate_stream  # noqa: E402
from .loading import Model, from_module, load_model, shipped_models  # noqa: E402
from .sampling import Greedy, Sample  # noqa: E402
from .streaming import GenerationStream, StreamPiece  # noqa: E402
from .trace import RoutingTrace  # noqa: E402

__all__ = [
    "GenerateOutput",
    "GenerationStats",
    "GenerationStream",
    "Greedy",
    "Model",
    "OffloadConfig",
    "RoutingTrace",
    "Sample",
    "StreamPiece",
    "forward",
    "from_module",
    "generate",
    "generate_stream",
    "load_model",
    "shipped_models",
]
__version__ = "0.1.0"
