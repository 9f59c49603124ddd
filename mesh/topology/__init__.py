"""The topology file and the plan made from it: what the user asked for (``schema.Topology``), what the run will do
(``plan.RunPlan``), where each process's GPUs are (``gpus``), whether this machine can hold it (``preflight``),
what ``--dry-run`` prints (``describe``) and the grammars a launcher's values are held to (``grammars``). Reading
and checking a topology starts no process and imports no backend."""
