"""The checkpoint formats `load_model` reads: Hugging Face directories (`hf`, `keys`) and the orbax
checkpoints `fmoe-convert` writes (`orbax_io`, `manifest`). The conversion CLI (`fmoe_jax.convert`) builds
on them."""
