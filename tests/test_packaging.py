"""pyproject.toml finds every package and ships every config, so `pip install .` ships all of
uqbench: its modules, uqbench.conf (the top-level conf/ through the link uqbench/conf) and
every config group at any depth."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_namespace_packages

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_configs_are_the_package_uqbench_conf():
    link = ROOT / "uqbench" / "conf"
    assert link.is_symlink() and link.resolve() == (ROOT / "conf").resolve()
    assert (ROOT / "conf" / "__init__.py").exists()


def test_package_discovery_finds_every_module_folder_and_config_group():
    find = _setuptools()["packages"]["find"]
    found = set(find_namespace_packages(where=str(ROOT), include=find["include"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "uqbench").rglob("__init__.py")}
    groups = {"uqbench.conf." + ".".join(p.relative_to(ROOT / "conf").parts)
              for p in (ROOT / "conf").rglob("*")
              if p.is_dir() and not any(part.startswith("__") for part in p.parts)}
    assert {"uqbench.runner", "uqbench.records", "uqbench.report"} <= folders
    assert {"uqbench.conf.hydra.launcher", "uqbench.conf.trainer.engine"} <= groups
    assert folders | groups <= found
    assert not {p for p in found if p.split(".")[0] != "uqbench"}  # tests/, conf/ stay out


def test_every_config_and_the_type_marker_ship_as_package_data():
    data = _setuptools()["package-data"]["*"]
    assert "*.yaml" in data and "py.typed" in data
    assert (ROOT / "uqbench" / "py.typed").exists()
