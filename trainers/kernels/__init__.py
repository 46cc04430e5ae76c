"""Faster or leaner replacements for stock transformers/peft pieces (fused LoRA products, attention on
CPU and for packed rows, activation memory). Importing one changes nothing: a run switches them on with
one call, ``trainers.kernels.install.install_kernels``, with its job's settings."""
