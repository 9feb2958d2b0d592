"""Hydra configs, installed as the package uqbench.conf (see pyproject.toml)."""
