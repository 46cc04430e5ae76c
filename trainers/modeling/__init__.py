"""Models: loading the model to train (LoRA or full, precision, resume), sampling from it, and the tiny
model tests and the demo train. Loading installs no kernels (``trainers.kernels.install``)."""
