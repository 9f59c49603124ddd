"""A run kept alive and steerable while the controller drives it: every call to an actor through the fleet, which
replaces what dies (``fleet``), what failed in words (``faults``), signals (``interrupts``), the owner's control
channel (``commands``) and the progress bar (``progress``)."""
