"""Trainer inner loops: one optimizer step over a ``TrainBatch``, around ``losses.compose_loss``.

Every inner loop (``native``, ``trl``, ``prime_rl``, ``torchtitan``) implements ``base.InnerLoop``
and reads the same ``TrainerConfig``; the model, its parallelism and the optimizer are the
library's, the loss math is never theirs: it is ``losses/``. ``base.MicroBatchLoop`` holds
the step they share. The configs live in ``config.py`` (no torch), so a topology is checked
without loading any trainer library; ``checkpoint.py`` writes and reads what a loop saves (the policy,
the optimizer state) as safetensors. This file imports nothing.
"""
