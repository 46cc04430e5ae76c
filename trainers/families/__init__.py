"""What several methods share: the one train-function signature (``entry``), preference pairs and their
reference model (``pairs``, ``reference``, ``reference_cache``), and rollouts for the online RL methods
(``rollout``, ``rl``). A method imports a family, never another method."""
