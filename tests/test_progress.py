"""How training reports its epochs: a bar on a terminal, one line per epoch in a log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import partial

import pytest
import torch

from tests.helpers import ROOT
from uqbench.runner.training import PROGRESS, Trainer, epoch_line, progress_mode


@pytest.mark.parametrize(("setting", "tty", "mode"), [
    ("auto", True, "bar"), ("auto", False, "lines"),
    (True, True, "bar"), (True, False, "lines"),     # the old boolean: true was "a bar"
    (False, True, "none"), (None, False, "none"),
    ("bar", False, "bar"), ("lines", True, "lines"), ("none", True, "none")])
def test_each_setting_picks_a_mode(setting, tty, mode):
    assert progress_mode(setting, tty=tty) == mode


def test_an_unknown_mode_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError) as err:
        Trainer(partial(torch.optim.SGD, lr=0.1), progress="verbose")
    assert "'verbose'" in str(err.value)
    assert all(mode in str(err.value) for mode in PROGRESS)


def test_an_epoch_line_shows_the_loss_the_validation_metrics_and_the_time():
    line = epoch_line(3, 10, {"train/loss": 0.123456, "epoch": 3, "lr": 0.01,
                              "val/nll": 1.5, "val/rmse": 0.25}, 12.34)
    assert line == "epoch 3/10 train/loss 0.1235 val/nll 1.5 val/rmse 0.25 elapsed 12.3s"


def test_a_run_logged_to_a_file_writes_one_line_per_epoch_and_no_bar(tmp_path):
    """stdout and stderr to a file, as under SLURM or CI: the default (auto) gives a line per
    epoch, with the validation metrics on the epochs that evaluate them (every val_every-th
    and the last), and no carriage return of a progress bar."""
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        subprocess.run(
            [sys.executable, "-m", "uqbench.runner.cli", "trainer.epochs=5", "trainer.val_every=2",
             "dataset.n_train=64", "dataset.n_val=16", "dataset.n_test=16", "dataset.n_ood=16",
             "backbone.width=4", "method.check_samples=0", "plot=false", "torch_threads=1",
             f"paths.runs_dir={tmp_path / 'runs'}"],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out,
            stderr=subprocess.STDOUT, timeout=300, check=True)
    text = log.read_text()
    assert "\r" not in text
    epochs = [line for line in text.splitlines() if re.search(r" - epoch \d+/5 ", line)]
    assert [re.search(r"epoch (\d+)/5", line).group(1) for line in epochs] == [
        "1", "2", "3", "4", "5"]
    assert [("val/nll" in line) for line in epochs] == [False, True, False, True, True]
    assert all(re.search(r"train/loss \S+ .*elapsed \d+\.\ds$", line) for line in epochs)
