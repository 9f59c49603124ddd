"""The rollout data contract: what a generator hands the trainer (rollouts) and the batch made of it."""
