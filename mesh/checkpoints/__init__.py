"""Checkpoints as a run's way out and back in: what one must agree on with a topology (``fingerprint``), what
``--resume`` reads from it (``resume``), and one written as a Hugging Face model directory (``export``)."""
