"""tunehouse trainers: post-training methods (SFT now; DPO, GRPO, PPO later) on torch + transformers + peft.

The library imports nothing else of tunehouse and owns its loop: step-level cancel/pause through
callbacks, exact resume from checkpoints, and live metrics. Entry points: ``trainers.sft.train_sft``;
``trainers.tiny_model.build_tiny_model`` for tests and the demo.
"""
