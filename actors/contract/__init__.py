"""The rollout data contract: what a generator hands the trainer (rollouts, a teacher's top-k) and the batch made
of it (``train_batch.py``)."""
