"""The orchestrator. The command-line programs sit here (``python -m mesh.run``, ``mesh.ctl``, ``mesh.export``,
``mesh.report``, and ``mesh.reference`` for contributors: it writes docs/topology-reference.md); the rooms below
hold what they use, and no room imports a program:

    topology/     the topology file and the plan made from it, read and checked (no process starts), and the
                  reference page of its keys
    launchers/    where the plan's processes start: this host, worker processes, Slurm, Kubernetes
    runtime/      running a plan: its actors kept alive, signals, the control channel, DiLoCo replicas, retraining
    controller/   the training loop that drives the actors step by step, and the data it moves
    checkpoints/  what a checkpoint must agree on, what a resume reads, and a checkpoint out as a model
    records/      what a run writes as it goes: the run directory, metrics, trackers, the timeline, figures; and
                  the run read back for mesh.report
"""
