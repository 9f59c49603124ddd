"""matplotlib for the figures a run draws (``reward.png``, ``timeline.png``, ``report.png``), loaded only when one
is drawn: a run that draws nothing never imports it."""


def pyplot():
    """matplotlib's pyplot on the Agg backend: runs draw on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
