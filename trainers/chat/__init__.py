"""Chat rows and chat formats, torch-free: what an OpenAI chat row may hold (``rows``), read once into the
shape every chat template reads, and how each model family's output is read back (``formats``). The
upload validator, the trainers, the estimate, the chat completions endpoint and the docs all use these."""
