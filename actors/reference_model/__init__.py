"""The KL reference model: scores rollouts with frozen weights, in the trainer or on its own mesh."""
