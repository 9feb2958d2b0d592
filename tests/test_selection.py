"""Choosing a setting on the validation split from a grid of finished runs."""

from __future__ import annotations

import pytest

from uqbench.report.selection import choose, main


def _run(backbone: str, method: str, lr: float, seed: int, nll: float) -> dict:
    return {"experiment": "grid", "backbone": backbone, "seed": seed,
            "settings": {"trainer": {"optimizer": {"lr": lr}}, "method": {"name": method}},
            "metrics": {"val/nll": nll}}


def test_the_lowest_mean_validation_metric_wins_per_backbone_and_method():
    runs = [_run("a", "sve", 0.1, 0, 0.5), _run("a", "sve", 0.1, 1, 0.3),     # mean 0.4
            _run("a", "sve", 0.01, 0, 0.35), _run("a", "sve", 0.01, 1, 0.55),  # mean 0.45
            _run("a", "de", 0.001, 0, 0.2), _run("a", "de", 0.003, 0, float("nan")),
            _run("b", "sve", 0.1, 0, 0.9), _run("b", "sve", 0.01, 0, 0.8)]
    table = choose(runs, ["trainer.optimizer.lr"], "val/nll")
    assert table["a"]["sve"][0] == (0.1,) and table["a"]["sve"][1] == {(0.1,): 0.4,
                                                                       (0.01,): 0.45}
    assert table["a"]["de"] == ((0.001,), {(0.001,): 0.2})    # a NaN score is no candidate
    assert table["b"]["sve"][0] == (0.01,)


def test_several_keys_are_chosen_together():
    runs = [_run("a", "sve", 0.1, 0, 0.5), _run("a", "sve", 0.1, 0, 0.2)]
    runs[1]["settings"]["trainer"]["decay_to"] = "init"      # the other run leaves it unset
    table = choose(runs, ["trainer.optimizer.lr", "trainer.decay_to"], "val/nll")
    assert table["a"]["sve"][0] == (0.1, "init")


def test_no_runs_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nothing", "--runs", str(tmp_path)])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("error: no runs of experiment 'nothing'")
