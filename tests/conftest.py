"""Shared fixtures. Tests never touch the network: Hub and W&B run offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

import uqbench.runner.cli  # noqa: E402,F401  (registers the config resolvers)


@pytest.fixture
def compose_cfg():
    """Compose the real conf/ with overrides, as the CLI would (without running)."""

    def _compose(overrides: list[str] | None = None, return_hydra_config: bool = False):
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # no job: run folders get no override level
        with initialize_config_module("uqbench.conf", version_base="1.3"):
            return compose("config", overrides=overrides or [],
                           return_hydra_config=return_hydra_config)

    yield _compose
    GlobalHydra.instance().clear()


@pytest.fixture(scope="module")
def cfg():
    """Compose the real conf/ once per module: ``cfg(*overrides)`` → the composed config."""
    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))
    GlobalHydra.instance().clear()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and are immune to a busy machine's contention);
    use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def checkout_runs_untouched():
    """Every test writes its runs under a temporary folder: the checkout's runs/ (a user's
    results) holds after the suite exactly the entries it held before."""
    from pathlib import Path

    runs = Path(__file__).resolve().parents[1] / "runs"
    before = set(runs.iterdir()) if runs.is_dir() else set()
    yield
    after = set(runs.iterdir()) if runs.is_dir() else set()
    assert after <= before, (f"the test suite left {sorted(map(str, after - before))} in the "
                             f"checkout's runs/ (a test ran a job without a temporary runs "
                             f"folder or eval target)")
