"""tunehouse trainers: post-training methods (SFT, DPO and the preference methods, reward models, GRPO,
RLOO, online DPO, PPO) on torch, transformers and peft. The library imports nothing else of tunehouse and
owns its loop: step-level cancel/pause through callbacks, exact resume from checkpoints, live metrics.

Layers, each importing only those below it (``make lint`` checks it with import-linter):

    methods/     one module per method: its config and train function; no method imports another
    families/    what methods share: the entry signature, preference pairs, rollouts
    rewards/     graders, the reward set, a reward model as a scorer
    modeling/    loading the model to train, sampling, the tiny test model
    data/        training-file formats, tokenization, packing, collation
    losses/ kernels/   pure loss and advantage functions | optional faster kernels (installed explicitly)
    core/        the loop, checkpoints, schedule, precision, distributed, config, errors
    registry     every method declared once (torch-free; the service reads it)

Entry points: ``trainers.registry.METHODS[name].trainer`` (e.g. ``trainers.methods.sft:train_sft``), each
with its config; ``trainers.rewards.graders.build_grader`` for RL rewards;
``trainers.modeling.tiny_model.build_tiny_model`` for tests and the demo.
"""
