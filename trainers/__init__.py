"""tunehouse trainers: post-training methods (SFT, DPO, reward models, GRPO, PPO) on torch, transformers
and peft.

The library imports nothing else of tunehouse and owns its loop: step-level cancel/pause through
callbacks, exact resume from checkpoints, and live metrics. Entry points: ``trainers.methods.sft.train_sft``,
``trainers.methods.dpo.train_dpo``, ``trainers.methods.reward_model.train_reward_model`` (and ``load_reward_scorer`` to
score with the result), ``trainers.methods.grpo.train_grpo`` and ``trainers.methods.ppo.train_ppo`` (reward functions from
``trainers.rewards.graders.build_grader``); each takes its method's config, a subclass of
``trainers.core.config.TrainingConfig``. ``trainers.modeling.tiny_model.build_tiny_model`` for tests and the demo.
"""
