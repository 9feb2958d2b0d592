"""`make bench` records and their files: ``tables/bench.json`` and ``tables/bench.md``.

A record is one figure: our value beside the anchor (what a user would otherwise run) measured
in the same process, the target and whether it is met. The JSON file is a list of records, so
the README table and any later check read the same numbers.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

KEYS = ("figure", "ours", "anchor", "anchor_value", "target", "unit", "device")


@dataclasses.dataclass
class Record:
    """One benchmark figure.

    ours / anchor_value: the measured numbers (None: not measured, ``note`` says why).
    target: the bound ours must stay at or below (None: reported, no target); ``target_rule``
    says where it comes from (e.g. "anchor / 3", or a fixed number). ``section`` groups rows
    in the Markdown file.
    """

    figure: str
    ours: float | None
    unit: str
    device: str
    anchor: str | None = None
    anchor_value: float | None = None
    target: float | None = None
    target_rule: str | None = None
    section: str = ""
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None or self.ours is None or not math.isfinite(self.ours):
            return None
        return self.ours <= self.target + 1e-12

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"met": self.met}


def versions() -> dict[str, str]:
    """Versions of the packages a reader needs to compare figures (absent ones left out)."""
    out = {"python": platform.python_version()}
    for name in ("torch", "timm", "transformers", "uqbench", "fastbnns", "torch-uncertainty"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "×":
        return f"{value:.2f}×"
    if unit == "%":
        return f"{value:.3g} %"
    if unit == "GB":
        return f"{value:.3g} GB"
    if unit == "ms":
        return f"{value:.3g} ms"
    return f"{value:.3g}" + (f" {unit}" if unit else "")


def _cell(text: str) -> str:
    """Text safe inside one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _verdict(r: Record) -> str:
    met = r.met
    if r.ours is None:
        return "not measured"
    return "—" if met is None else ("met" if met else "**missed**")


def markdown(records: list[Record], header: dict[str, Any]) -> str:
    lines = [f"# uqbench benchmark ({header['date']})", "",
             f"Device: {header['device']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in header["versions"].items()) + ".", "",
             "Ratios are measured side by side in one process (interleaved, warm-up excluded, "
             "medians). Each anchor is what a user would otherwise run, measured in the same "
             "process; a missing anchor is reported as skipped.", ""]
    sections: dict[str, list[Record]] = {}
    for r in records:
        sections.setdefault(r.section, []).append(r)
    for section, rows in sections.items():
        if section:
            lines += [f"## {section}", ""]
        lines += ["| figure | uqbench | anchor | anchor value | target | verdict | note |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            target = "—" if r.target is None else (
                f"≤ {_fmt(r.target, r.unit)}" + (f" ({r.target_rule})" if r.target_rule else ""))
            lines.append(f"| {_cell(r.figure)} | {_fmt(r.ours, r.unit)} | {r.anchor or '—'} | "
                         f"{_fmt(r.anchor_value, r.unit)} | {target} | {_verdict(r)} | "
                         f"{_cell(r.note)} |")
        lines.append("")
    return "\n".join(lines)


def write(records: list[Record], out_dir: Path, device: torch.device) -> dict[str, Any]:
    """Write ``bench.json`` (a list of records) and ``bench.md`` into ``out_dir``; returns the
    header (date, device, versions). Both are written to a temporary name, then renamed."""
    header = {"date": dt.date.today().isoformat(), "device": device_name(device),
              "versions": versions()}
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = json.dumps([r.to_json() | {"date": header["date"]} for r in records], indent=1)
    for name, text in (("bench.json", payload + "\n"),
                       ("bench.md", markdown(records, header))):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)
    return header
