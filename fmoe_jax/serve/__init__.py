"""fmoe-serve: an OpenAI-compatible HTTP server over one fmoe_jax model (`fmoe-serve MODEL`, `cli.py`).

`app.py` holds the server object and its routes, `gate.py` the API key and body-size checks in front of them,
`protocol.py` OpenAI's bodies, `bodies.py` how each endpoint writes them, `scheduler.py` the queue and the
thread that calls the model, `metrics.py` the Prometheus metrics. Importing this package imports none of the
server's dependencies (the `serve` extra): `fmoe-serve --help` works without them.
"""
