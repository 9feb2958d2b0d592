"""`make bench` records and their files: ``tables/bench.json`` and ``tables/bench.md``.

A record is one figure: our value beside the anchor (what a user would otherwise run) measured
in the same process, the target and the verdict. The JSON file is a list of records, so the
README table and any later check read the same numbers.

**The verdict rule.** A timed figure is measured in rounds (``timing.Measured``): its value is
the median over the rounds and its interval a distribution-free 90 % confidence interval for
that median (``timing.median_interval``: order statistics; the range at 5 rounds, the second
smallest to the second largest at 10), for ours and for the anchor alike. The verdict reads
ours / target round by round (:func:`to_target`): a target computed from an anchor (e.g.
anchor / 3) was timed in the same rounds as ours, so each round's ratio compares two figures
timed together, and a machine that is slower in one round moves both. A targeted row is
**met** when that ratio's whole interval is at or under 1, **missed** when it is wholly above
1, and **unclear** otherwise. A figure that is counted, not timed (memory), is a point, and its
verdict is met or missed.
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

from uqbench.bench.timing import Measured

KEYS = ("figure", "ours", "anchor", "anchor_value", "target", "unit", "device")
VERDICT_RULE = ("ours / target, round by round (an anchor-relative target: ours over the anchor "
                "timed in the same round), has a distribution-free 90 % confidence interval for "
                "its median over rounds, from order statistics; met: the whole interval at or "
                "under 1; missed: wholly above 1; unclear: otherwise")


def interval(value: float | None) -> tuple[float, float] | None:
    """A figure's run-to-run interval (``timing.median_interval`` of its rounds), or the point
    itself."""
    if value is None:
        return None
    return value.interval if isinstance(value, Measured) else (float(value), float(value))


def _rounds(value: float | None) -> list[float] | None:
    rounds = getattr(value, "rounds", None)
    return list(rounds) if rounds else None


def to_target(ours: float | None, target: float | None) -> float | None:
    """ours / target, round by round where both were measured in the same rounds (a target
    computed from an anchor timed beside ours), else each round of ours over the target's
    value; None without both."""
    if ours is None or target is None:
        return None
    paired = len(_rounds(ours) or ()) == len(_rounds(target) or ()) > 0
    if paired or _rounds(target) is None:
        return ours / target
    return ours / float(target)


def verdict(ours: float | None, target: float | None) -> str | None:
    """met | missed | unclear by :data:`VERDICT_RULE`; None without a target or a finite
    figure."""
    bound = interval(to_target(ours, target))
    if bound is None or not all(math.isfinite(v) for v in bound):
        return None
    if bound[1] <= 1 + 1e-12:
        return "met"
    if bound[0] > 1 + 1e-12:
        return "missed"
    return "unclear"


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
    def verdict(self) -> str | None:
        return verdict(self.ours, self.target)

    @property
    def met(self) -> bool | None:
        """True / False where the verdict is met / missed; None where unclear or untargeted."""
        return {"met": True, "missed": False}.get(self.verdict or "")

    def to_json(self) -> dict[str, Any]:
        rounds = _rounds(self.ours)
        plain = {k: (float(v) if isinstance(v, float) else v)
                 for k, v in dataclasses.asdict(self).items()}
        return plain | {"ours_interval": interval(self.ours),
                        "anchor_interval": interval(self.anchor_value),
                        "target_interval": interval(self.target),
                        "to_target_interval": interval(to_target(self.ours, self.target)),
                        "rounds": len(rounds) if rounds else None,
                        "ours_rounds": rounds,
                        "anchor_rounds": _rounds(self.anchor_value), "verdict": self.verdict,
                        "verdict_rule": VERDICT_RULE if self.target is not None else None,
                        "met": self.met}


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
    """The figure, with its run-to-run interval where it was measured in rounds."""
    if value is None:
        return "—"
    span = interval(value)
    if span is not None and span[0] != span[1]:
        return f"{_one(float(value), unit)} [{_one(span[0], unit)}, {_one(span[1], unit)}]"
    return _one(float(value), unit)


def _one(value: float, unit: str) -> str:
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
    if r.ours is None:
        return "not measured"
    return {"met": "met", "missed": "**missed**", "unclear": "unclear"}.get(r.verdict or "", "—")


def markdown(records: list[Record], header: dict[str, Any]) -> str:
    lines = [f"# uqbench benchmark ({header['date']})", "",
             f"Device: {header['device']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in header["versions"].items()) + ".", "",
             "Ratios are measured side by side in one process (interleaved, warm-up excluded), "
             "in rounds: each timed figure is the median over its rounds, with its interval in "
             "brackets. Each anchor is what a user would otherwise run, measured in the same "
             "process; a missing anchor is reported as skipped. Verdicts: " + VERDICT_RULE
             + ".", ""]
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


def write(records: list[Record], out_dir: Path, device: torch.device, stem: str = "bench"
          ) -> dict[str, Any]:
    """Write ``<stem>.json`` (a list of records) and ``<stem>.md`` into ``out_dir``; returns the
    header (date, device, versions). Both are written to a temporary name, then renamed."""
    header = {"date": dt.date.today().isoformat(), "device": device_name(device),
              "versions": versions()}
    payload = json.dumps([r.to_json() | {"date": header["date"]} for r in records], indent=1)
    write_files(out_dir, {f"{stem}.json": payload + "\n", f"{stem}.md": markdown(records, header)})
    return header


def write_files(out_dir: Path, texts: dict[str, str]) -> None:
    """Write each ``{name: text}`` into ``out_dir`` through a temporary name and one rename
    (never half a file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)
