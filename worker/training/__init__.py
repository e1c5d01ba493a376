"""One training loop over a declared backend protocol.

- :mod:`.loop`: the run skeleton (selection, encoding, seed, adapter session, save, metrics, result),
  generic over a backend and a learning signal.
- :mod:`.policy_gradient`: the worker's learning signal (reference and behaviour log-probs,
  micro-batched optimizer steps with the objective of :mod:`rlfleet.worker.objective`).
- :mod:`.advantages`: the advantage rule and the reward baseline, plain numbers.
- :mod:`.reward_model` (plain numpy) and :mod:`.reward_features`: the user's reward model, fitted and
  cross-validated on a run's ratings (its AUC is a run metric).
- :mod:`.scoring`: what the gate and the tests measure on a model (log-probs, KL, entropy, samples).
- :mod:`.backend`: the tensor-level operations a backend provides.
- :mod:`.torch_backend` (torch + peft) and :mod:`.mlx_backend` (MLX, with :mod:`.mlx_model` for
  loading and the peft file format): the two backends.

Nothing is imported here, so that the framework-free modules load without torch or MLX.
"""
