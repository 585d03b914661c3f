"""The one way a plot is opened and saved. matplotlib is imported only when a plot is drawn, so
`lab report --check` does without it; the PNG carries no version stamp, so it depends only on the
records it was drawn from."""
PLOT_META = {"Software": None}


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path) -> None:
    """Lay out, write at the lab's resolution, and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PLOT_META)
    pyplot().close(fig)
