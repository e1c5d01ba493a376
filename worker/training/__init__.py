"""The training run's parts that every backend shares."""
