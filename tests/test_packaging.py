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
    # config folders at any depth (trainer/engine, Hydra's own hydra/launcher)
    folders = [p for p in (ROOT / "conf").rglob("*")
               if p.is_dir() and not any(part.startswith("__") for part in p.parts)]
    groups = {"uqbench.conf." + ".".join(p.relative_to(ROOT / "conf").parts) for p in folders}
    assert "uqbench.conf.hydra.launcher" in groups
    assert groups <= listed, f"add the config groups to packages: {sorted(groups - listed)}"
    with_yaml = {"uqbench.conf." + ".".join(p.relative_to(ROOT / "conf").parts)
                 for p in folders if any(p.glob("*.yaml"))}
    data = set(meta["package-data"])
    assert with_yaml <= data, f"add to package-data: {sorted(with_yaml - data)}"
