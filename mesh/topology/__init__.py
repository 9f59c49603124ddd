"""The topology file and the plan made from it: what the user asked for (``schema.Topology``), what the run will do
(``plan.RunPlan``), where each process's GPUs are (``gpus``), whether this machine can hold it (``preflight``) and
what ``--dry-run`` prints (``describe``). Reading and checking a topology starts no process and imports no backend."""
