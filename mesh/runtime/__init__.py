"""Running a plan: the run's processes and actors, kept alive (``run``, ``fleet``), what failed in words
(``faults``), signals (``interrupts``), the owner's control channel (``commands``), DiLoCo replicas
(``replicas``), training on a recorded run's batches (``retrain``) and the progress bar (``progress``)."""
