"""fmoe_jax.research: the code behind the project's experiments, not used for serving.

Training tiny MoE models (`train`), the corpora, prompt sets and arrival traces of the experiments
(`workloads`), tokenizer training (`tokenizer`), and evaluating the learned predictors of the ProMoE and
DuoServe baselines (`predictor_training`; training them is `fmoe_jax.offload.predictor_training`'s). The
benchmarks (`benchmarks/`) call these; `fmoe_jax`, `fmoe_jax.models`, `fmoe_jax.offload` and
`fmoe_jax.convert` never import them.
"""
