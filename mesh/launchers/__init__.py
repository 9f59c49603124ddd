"""Launchers: where a run's processes start (this host, worker processes, Slurm, Kubernetes), one file each.

What a launcher is and how one is named in a topology: ``mesh/topology/launcher.py``; the grammars of the values
they write: ``mesh/topology/grammars.py``.
"""
