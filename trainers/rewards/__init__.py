"""Rewards for RL methods: graders in OpenAI's shape, the formula of a ``multi`` grader, the reward set a
run scores with, and a reward model as a scorer. ``graders`` and ``formula`` import no torch (the API
validates and runs graders with them)."""
