"""The orchestrator: topology schema, launchers, the controller loop, the run directory, the CLI."""
