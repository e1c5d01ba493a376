"""The learning benchmark: a scripted user rates answers through the real pipeline; held-out
prompts measure whether the model moved toward the hidden preference. `python -m bench.learning --help`."""
