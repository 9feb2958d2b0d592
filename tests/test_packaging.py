"""pyproject.toml names every package folder, so `pip install .` ships all of uqbench."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(meta["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "uqbench").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert meta["package-dir"]["uqbench.conf"] == "conf"
    assert (ROOT / "conf" / "__init__.py").exists()
    groups = {f"uqbench.conf.{p.name}" for p in (ROOT / "conf").iterdir()
              if p.is_dir() and not p.name.startswith("__")}
    assert groups <= listed, f"add the config groups to packages: {sorted(groups - listed)}"
    assert groups <= set(meta["package-data"]), sorted(groups - set(meta["package-data"]))
