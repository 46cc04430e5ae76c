"""One module per method: its config and its train function (``trainers.registry`` names both). No
method imports another; what they share lives in ``trainers.families``."""
