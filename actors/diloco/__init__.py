"""DiLoCo across RL replicas: the outer loop (``syncer.py``), its config and its transports.

Importing the package imports neither torch nor a transport's library: the topology check
reads ``config.py`` alone.
"""
