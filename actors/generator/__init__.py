"""The Generator actor: samples rollouts through an engine (``engines/``) with the weights it follows."""
