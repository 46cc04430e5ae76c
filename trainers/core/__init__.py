"""The training loop and what every run shares: callbacks, checkpoints, the schedule, precision, the
distributed helpers, RNG, the base config and the library's errors. Imports nothing of trainers but the
registry (lint: `make lint`, import-linter's layers)."""
