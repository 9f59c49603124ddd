"""What a run writes as it goes: its directory (``rundir``) and the thread that writes it (``logthread``),
metrics to TensorBoard (``events``) and trackers (``sinks``), the timeline of actor calls (``trace``), and the
figures drawn from them (``figures``)."""
