"""uqbench: a command-line experiment runner for uncertainty quantification research."""

__version__ = "0.1.0"
