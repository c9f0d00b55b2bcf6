"""fmoe_jax: serve Mixture-of-Experts language models in JAX with experts offloaded to host memory.

Public API (see README):
    model = fmoe_jax.load_model(path_or_name, offload=None | fmoe_jax.OffloadConfig(...))
    out = fmoe_jax.generate(model, prompts, max_new_tokens=32, sampling=fmoe_jax.Greedy(), seed=0)
    out = fmoe_jax.generate(model, "Hello", do_sample=True, temperature=0.7, top_p=0.9)   # HF names
    for piece in fmoe_jax.generate_stream(model, [{"role": "user", "content": "Hi"}]): ...
    logits = fmoe_jax.forward(model, token_ids)
    model = fmoe_jax.random_model(preset_or_hf_config, offload=...)   # random weights, real sizes
    out = fmoe_jax.generate(model, prompts, forced_routing=trace)        # a recorded trace's routing
"""

from fmoe_jax.offload.config import OffloadConfig

from .generation import GenerateOutput, GenerationStats, forward, generate, generate_stream
from .loading import Model, from_module, load_model, shipped_models
from .random_model import random_model
from .sampling import Greedy, Sample
from .streaming import GenerationStream, StreamPiece
from .trace import RoutingTrace

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
    "random_model",
    "shipped_models",
]
__version__ = "0.1.0"
