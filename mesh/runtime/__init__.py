"""Running a plan: its processes and actors started and the controller driven over them (``run``), DiLoCo
replicas (``replicas``) and training on a recorded run's batches (``retrain``). What keeps a run alive and
steerable meanwhile is ``mesh/supervision``'s."""
