"""fmoe_jax: serve Mixture-of-Experts language models in JAX with experts offloaded to host memory.

Public API (see README):
    model = fmoe_jax.load_model(path_or_name, offload=None | fmoe_jax.OffloadConfig(...))
    out = fmoe_jax.generate(model, prompts, max_new_tokens=32, sampling=fmoe_jax.Greedy(), seed=0)
    logits = fmoe_jax.forward(model, token_ids)
"""

from fmoe_jax.offload.config import OffloadConfig

from .generation import GenerateOutput, GenerationStats, forward, generate
from .loading import Model, from_module, load_model, shipped_models
from .sampling import Greedy, Sample
from .trace import RoutingTrace

__all__ = [
    "GenerateOutput",
    "GenerationStats",
    "Greedy",
    "Model",
    "OffloadConfig",
    "RoutingTrace",
    "Sample",
    "forward",
    "from_module",
    "generate",
    "load_model",
    "shipped_models",
]
__version__ = "0.1.0"
