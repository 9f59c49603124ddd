"""The orchestrator. The command-line programs sit here (``python -m mesh.run``, ``mesh.ctl``, ``mesh.export``,
``mesh.report``, and ``mesh.reference`` for contributors: it writes docs/topology-reference.md); the rooms below
hold what they use. Each room imports only rooms listed under it, and no room imports a program:

    runtime/      running a plan: its actors started and the controller driven over them, DiLoCo replicas,
                  retraining on a recorded run
    checkpoints/  what a checkpoint must agree on, what a resume reads, and a checkpoint out as a model
    controller/   the training loop that drives the actors step by step, and the data it moves
    supervision/  a run kept alive and steerable: the fleet its actor calls go through, faults in words, signals,
                  the owner's control channel, the progress bar
    records/      what a run writes as it goes: the run directory, metrics, trackers, the timeline, figures; and
                  the run read back for mesh.report
    launchers/    where the plan's processes start: this host, worker processes, Slurm, Kubernetes
    topology/     the topology file and the plan made from it, read and checked (no process starts), the grammars
                  its launcher values are held to, and the reference page of its keys
"""
