"""How training reports its epochs: a bar on a terminal, log lines in a log (the validated
epochs by default, every trainer.log_every-th when set)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import partial

import pytest
import torch

from tests.helpers import ROOT
from uqbench.runner.engine.loop import PROGRESS, Trainer, epoch_line, progress_mode


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


def _logged(tmp_path, *extra: str) -> list[str]:
    """The epoch lines of a 5-epoch run (validation every 2nd) logged to a file."""
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        subprocess.run(
            [sys.executable, "-m", "uqbench.runner.cli", "trainer.epochs=5", "trainer.val_every=2",
             "dataset.n_train=64", "dataset.n_val=16", "dataset.n_test=16", "dataset.n_ood=16",
             "backbone.width=4", "method.check_samples=0", "plot=false", "torch_threads=1",
             f"paths.runs_dir={tmp_path / 'runs'}", *extra],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out,
            stderr=subprocess.STDOUT, timeout=300, check=True)
    text = log.read_text()
    assert "\r" not in text  # no carriage return of a progress bar
    return [line for line in text.splitlines() if re.search(r" - epoch \d+/5 ", line)]


def test_a_run_logged_to_a_file_writes_the_validated_epochs_and_no_bar(tmp_path):
    """stdout and stderr to a file, as under SLURM or CI: the default (auto) writes the first
    epoch, those that validate (every val_every-th) and the last, with their metrics."""
    epochs = _logged(tmp_path)
    assert [re.search(r"epoch (\d+)/5", line).group(1) for line in epochs] == [
        "1", "2", "4", "5"]
    assert [("val/nll" in line) for line in epochs] == [False, True, True, True]
    assert all(re.search(r"train/loss \S+ .*elapsed \d+\.\ds$", line) for line in epochs)


def test_log_every_one_writes_every_epoch(tmp_path):
    epochs = _logged(tmp_path, "trainer.log_every=1")
    assert [re.search(r"epoch (\d+)/5", line).group(1) for line in epochs] == [
        "1", "2", "3", "4", "5"]
    assert [("val/nll" in line) for line in epochs] == [False, True, False, True, True]
    assert all(re.search(r"train/loss \S+ .*elapsed \d+\.\ds$", line) for line in epochs)


def test_log_every_is_checked_and_no_part_of_a_runs_identity():
    from uqbench.identity import differences

    with pytest.raises(ValueError, match="trainer.log_every must be >= 1"):
        Trainer(optimizer=torch.optim.Adam, log_every=0)
    assert differences({"trainer": {"log_every": None}}, {"trainer": {"log_every": 1}}) == []


@pytest.mark.parametrize("epochs,val_every,expected", [
    (300, 10, [1, *range(30, 301, 30)]),   # about ten lines, each a validated epoch
    (10, 1, list(range(1, 11))),
    (5, 2, [1, 2, 4, 5]),
    (7, 0, list(range(1, 8)))])             # no validation while training: every epoch
def test_the_default_logs_about_ten_validated_epochs(epochs, val_every, expected):
    from types import SimpleNamespace

    from uqbench.runner.engine.loop import logged_epoch

    trainer = SimpleNamespace(epochs=epochs, val_every=val_every, log_every=None)
    assert [e for e in range(1, epochs + 1) if logged_epoch(e, trainer)] == expected


def test_a_finished_run_ends_with_its_metrics_on_one_screen():
    from uqbench.runner.cli import run_summary

    metrics = {f"test/metric_{i}": i / 7 for i in range(20)} | {"ood/nll": 5.85551,
                                                                 "val/nll": 0.1,
                                                                 "test_c/fog/1/acc": 0.5}
    text = run_summary({"run": "default/x/seed0", "metrics": metrics}, width=80)
    lines = text.splitlines()
    assert lines[0] == "default/x/seed0:" and all(len(line) <= 80 for line in lines)
    assert len(lines) <= 12  # one screen, however many metrics a split has
    for k in [*(f"test/metric_{i}" for i in range(20)), "ood/nll"]:
        assert f"{k}={round(metrics[k], 4)}" in text.split()
    assert "val/nll" not in text and "test_c/" not in text
    assert lines[-1].split() == ["ood/nll=5.8555"]  # each split on lines of its own
