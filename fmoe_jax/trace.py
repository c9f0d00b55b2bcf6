"""Routing traces (`RoutingTrace`), as `generate(..., record_trace=True)` returns them.

The format lives with the simulator and the policies that read it (`fmoe_jax.offload.trace`); this name
stays for the code that imports it from the public layer.
"""

from fmoe_jax.offload.trace import FORMAT_VERSION, Iteration, RequestTrace, RoutingTrace

__all__ = ["FORMAT_VERSION", "Iteration", "RequestTrace", "RoutingTrace"]
