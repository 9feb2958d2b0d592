"""An experiment's figures: mean over seeds with sample-std error bars (ddof=1; none with one
seed), one line per hue value, one row of panels per facet value. The PNG carries no date or
software version, so the same runs give the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from uqbench.report.building import show_key
from uqbench.report.claims import get_path, sort_key
from uqbench.report.validation import Run, key_list


def y_keys(figure: dict[str, Any]) -> list[Any]:
    """The y keys a figure draws, one panel each: ``[None]`` for a ``series`` figure."""
    if figure.get("series"):
        return [None]
    return figure["y"] if isinstance(figure["y"], list) else [figure["y"]]



def _label(run: Run, keys: Any) -> tuple[tuple, str]:
    """(sort key, label) of a run's hue or facet: its values, joined by ", " for several keys."""
    values = [get_path(run, k) for k in key_list(keys)]
    return tuple(sort_key(v) for v in values), ", ".join(show_key(v) for v in values)


def figure_points(runs: list[Run], figure: dict[str, Any]) -> pd.DataFrame:
    """The points a figure draws, in drawing order: one row per (facet, hue, y key, x) with
    the mean, the sample std (ddof=1; NaN with one value) and the count of the runs' values
    there (runs without the value are left out). x is the run's ``x`` value, or the label of
    a ``series`` key; ``y`` is the position of the y key (0 for a series)."""
    series = figure.get("series")
    ys = y_keys(figure)
    hues = [_label(run, figure["hue"]) for run in runs]
    facets = [_label(run, figure["facet"]) if figure.get("facet") else ((), "") for run in runs]
    hue_rank = {h: i for i, h in enumerate(sorted(set(hues)))}
    facet_rank = {f: i for i, f in enumerate(sorted(set(facets)))}
    records = []
    for run, hue, facet in zip(runs, hues, facets, strict=True):
        if series:  # x: the key's label, in the order the spec lists them
            points = [(i, label, 0, get_path(run, key)) for i, (label, key)
                      in enumerate(zip(figure["labels"], series, strict=True))]
        else:
            x = get_path(run, figure["x"])
            points = [(x, x, j, get_path(run, y)) for j, y in enumerate(ys)]
        records += [(facet_rank[facet], facet[1], hue_rank[hue], hue[1], j, order, x, value)
                    for order, x, j, value in points if order is not None and value is not None]
    frame = pd.DataFrame(records, columns=["facet_rank", "facet", "hue_rank", "hue", "y",
                                           "order", "x", "value"])
    frame["value"] = frame["value"].astype(float)
    return (frame.groupby(["facet_rank", "hue_rank", "y", "order"], sort=True)
            .agg(facet=("facet", "first"), hue=("hue", "first"), x=("x", "first"),
                 mean=("value", "mean"), std=("value", "std"), count=("value", "count"))
            .reset_index())


def summary_figure(runs: list[Run], figure: dict[str, Any], path: Path, title: str) -> Path:
    """Mean over seeds (error bars: sample std, ddof=1; none with one seed), one line per hue
    value, one row of panels per facet value: y against x per y key (e.g. NLL vs parameters),
    or one ``series`` of keys against its ``labels`` (e.g. accuracy per corruption severity).
    The PNG carries no software version, so the same runs give the same bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = figure.get("series")
    ys = y_keys(figure)
    points = figure_points(runs, figure)
    facets = sorted({_label(run, figure["facet"]) for run in runs}) if figure.get("facet") \
        else [((), "")]
    fig, axes = plt.subplots(len(facets), len(ys), figsize=(5 * len(ys), 3.8 * len(facets)),
                             squeeze=False)
    for row, (_, facet) in zip(axes, facets, strict=True):
        for j, (ax, ykey) in enumerate(zip(row, ys, strict=True)):
            panel = points[(points["facet"] == facet) & (points["y"] == j)]
            for _, line in panel.groupby("hue_rank", sort=True):
                ax.errorbar(line["x"].tolist(), line["mean"].tolist(),
                            yerr=line["std"].fillna(0.0).tolist(), marker="o", ms=4,
                            capsize=2, label=line["hue"].iloc[0])
            ax.set_xscale(figure.get("xscale", "linear"))
            ax.set_xlabel(figure.get("xlabel") or ("" if series else figure["x"].split(".")[-1]))
            ax.set_ylabel(figure.get("ylabel") or (ykey or "").split(".", 1)[-1])
            if figure.get("facet"):
                names = ", ".join(k.split(".")[-1] for k in key_list(figure["facet"]))
                ax.set_title(f"{names} = {facet}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, title=", ".join(k.split(".")[-1]
                                                      for k in key_list(figure["hue"])),
                          title_fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


