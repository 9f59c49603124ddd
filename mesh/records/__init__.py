"""What a run writes as it goes: its directory (``rundir``) and the thread that writes it (``logthread``),
metrics to TensorBoard (``events``) and trackers (``sinks``), the timeline of actor calls (``trace``), and the
figures drawn from them (``figures``); the run read back (``readers``, ``report``), and what of it a live run and
the programs that read it share (``layout``: the control channel's folder and its owner, events, checkpoints)."""
