"""fmoe-serve: an OpenAI-compatible HTTP server over one fmoe_jax model (`fmoe-serve MODEL`, `cli.py`).

`app.py` holds the routes, `protocol.py` OpenAI's bodies, `scheduler.py` the queue and the thread that calls
the model, `metrics.py` the Prometheus metrics. Importing this package imports none of the server's
dependencies (the `serve` extra): `fmoe-serve --help` works without them.
"""
