"""P2's settings chosen by code on validation splits: the three selection sweeps (ρ₀, the default
prior and KL weight, the diabetes KL weight) score val only, their recipe files record how each
choice was made, and the defaults read those files; the calibration rule's constraint holds for
every run of a candidate (``--require-each``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.helpers import ROOT, run_cli
from uqbench.report.selection import main

RECIPES = ROOT / "conf" / "recipe"
# sweep experiment → (its recipe file, the --key paths it chooses)
SWEEPS = {"p2_rho_select": ("p2_rho", ["method.rho_init"]),
          "p2_calibration_select": ("p2_bnn", ["method.prior", "method.kl_scale"]),
          "p2_diabetes_select": ("p2_diabetes", ["method.prior", "method.kl_scale"])}
COVERAGE_RULE = "val/coverage_2sigma=0.9:0.99 on every run"


def _recipe(name: str) -> dict:
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())


def _grid(compose_cfg, experiment: str) -> dict[str, list]:
    """The sweep's grid as its config states it: {sweep parameter: [values]}."""
    cfg = compose_cfg([f"experiment={experiment}"], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    return {k: [yaml.safe_load(v) for v in str(text).split(",")] for k, text in params.items()}


# --- --require-each: the calibration rule's "for every width and both variances" --------------

def _run(prior: str, kl: float, width: int, nll: float, coverage: float) -> dict:
    return {"experiment": "grid", "seed": 0,
            "settings": {"method": {"prior": prior, "kl_scale": kl},
                         "backbone": {"width": width}},
            "metrics": {"val/nll": nll, "val/coverage_2sigma": coverage}}


def _write(runs_dir: Path, runs: list[dict]) -> Path:
    for i, run in enumerate(runs):
        (runs_dir / f"run{i}").mkdir(parents=True)
        (runs_dir / f"run{i}" / "results.json").write_text(json.dumps(run))
    return runs_dir


GRID = [  # kl 0.1: mean coverage (0.97 + 0.87) / 2 = 0.92 is inside the band, width 4's is not
    _run("fixed", 0.1, 4, 0.20, 0.87), _run("fixed", 0.1, 64, 0.30, 0.97),
    _run("fixed", 0.3, 4, 0.40, 0.91), _run("fixed", 0.3, 64, 0.50, 0.98),
    _run("fixed", 1.0, 4, 0.10, 0.995), _run("fixed", 1.0, 64, 0.10, 0.999)]


@pytest.mark.parametrize("flag,kl", [("--require", 0.1), ("--require-each", 0.3)])
def test_require_each_holds_for_every_run_where_require_holds_for_the_mean(tmp_path, flag, kl):
    runs = _write(tmp_path / "runs", GRID)
    out = tmp_path / "recipe.yaml"
    assert main(["grid", "--runs", str(runs), "--key", "method.prior", "--key",
                 "method.kl_scale", "--group-by", "none", flag,
                 "val/coverage_2sigma=0.90:0.99", "--write", str(out)]) == 0
    recipe = yaml.safe_load(out.read_text())
    assert recipe["choices"] == {"prior": "fixed", "kl_scale": kl}
    excluded = {c["values"]["kl_scale"]: c.get("excluded") for c in recipe["groups"]["candidates"]}
    if flag == "--require":  # means 0.92, 0.945, 0.997
        assert excluded == {0.1: None, 0.3: None,
                            1.0: "val/coverage_2sigma mean 0.997 outside [0.9, 0.99]"}
    else:
        assert recipe["provenance"]["require"] == [COVERAGE_RULE]
        assert excluded == {
            0.1: "val/coverage_2sigma of 1 of 2 runs outside [0.9, 0.99] (runs: 0.87 … 0.97)",
            0.3: None,
            1.0: "val/coverage_2sigma of 2 of 2 runs outside [0.9, 0.99] (runs: 0.995 … 0.999)"}


def test_require_each_counts_a_run_without_the_metric_as_outside(tmp_path, capsys):
    runs = [_run("fixed", 0.3, 4, 0.4, 0.95), _run("fixed", 0.3, 64, 0.5, 0.95)]
    del runs[1]["metrics"]["val/coverage_2sigma"]
    with pytest.raises(SystemExit):
        main(["grid", "--runs", str(_write(tmp_path / "runs", runs)), "--key",
              "method.kl_scale", "--group-by", "none", "--require-each",
              "val/coverage_2sigma=0.90:0.99"])
    err = capsys.readouterr().err
    assert "no candidate meets val/coverage_2sigma=0.9:0.99 on every run" in err
    assert "1 of 2 runs outside [0.9, 0.99] (runs: 0.95 … 0.95, 1 not finite)" in err


def test_a_bad_require_each_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["grid", "--runs", str(tmp_path), "--require-each", "val/coverage_2sigma=0.99:0.9"])
    assert "--require-each 'val/coverage_2sigma=0.99:0.9' is not METRIC=LO:HI" in \
        capsys.readouterr().err


# --- the selection sweeps ----------------------------------------------------------------------

@pytest.mark.parametrize("experiment", sorted(SWEEPS))
def test_each_selection_sweep_scores_the_validation_split_only(compose_cfg, experiment):
    cfg = compose_cfg([f"experiment={experiment}"], return_hydra_config=True)
    assert cfg.experiment_name == experiment and experiment.endswith("_select")
    assert list(cfg.eval_splits) == ["val"]
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"  # a sweep, never one run
    grid = _grid(compose_cfg, experiment)
    for key in SWEEPS[experiment][1]:  # every chosen key is swept or fixed by the experiment
        assert key in grid or OmegaConf.select(cfg, key) is not None, key
    # every interpolation resolves (the recipe entries they read exist)
    OmegaConf.to_container(compose_cfg([f"experiment={experiment}"]), resolve=True)


def test_the_rho_sweep_uses_the_width_sweeps_elbo(compose_cfg):
    for experiment in ("p2_rho_select", "p2_rho_sensitivity", "p2_width_sweep"):
        method = compose_cfg([f"experiment={experiment}"]).method
        assert (method.prior, method.prior_std, method.kl_scale) == ("fixed", 1.0, 1.0)
    assert set(_grid(compose_cfg, "p2_rho_select")) == {
        "method.rho_init", "backbone.width", "method.variance", "seed"}


def test_the_diabetes_sweep_trains_as_p2_diabetes_on_each_outer_fold(compose_cfg):
    select = compose_cfg(["experiment=p2_diabetes_select", "seed=3"])
    reported = compose_cfg(["experiment=p2_diabetes", "seed=3"])
    assert select.dataset.fold == reported.dataset.fold == 3
    assert select.trainer.epochs == reported.trainer.epochs
    for key in ("folds", "split_seed", "val_fraction"):  # the same inner rows as the report's val
        assert select.dataset[key] == reported.dataset[key], key
    assert _grid(compose_cfg, "p2_diabetes_select")["seed"] == [0, 1, 2, 3, 4]


# --- the recipe files --------------------------------------------------------------------------

@pytest.mark.parametrize("experiment", sorted(SWEEPS))
def test_each_recipe_file_records_how_it_was_chosen(compose_cfg, experiment):
    name, keys = SWEEPS[experiment]
    recipe = _recipe(name)
    prov = recipe["provenance"]
    assert prov["sweep"] == experiment and prov["file"] == f"conf/recipe/{name}.yaml"
    assert (prov["metric"], prov["direction"], prov["group_by"]) == ("val/nll", "min", [])
    assert prov["keys"] == {k.split(".")[-1]: k for k in keys}
    assert prov["command"].startswith(f"uqbench-select {experiment} ")
    # the grid and seeds the runs held are the ones the sweep's config states: the recipe was
    # made from this sweep (a changed grid without a new selection fails here)
    grid = _grid(compose_cfg, experiment)
    cfg = compose_cfg([f"experiment={experiment}"])
    for key in keys:
        stated = grid.get(key, [OmegaConf.select(cfg, key)])
        assert sorted(prov["grid"][key.split(".")[-1]], key=str) == sorted(stated, key=str), key
    assert prov["seeds"] == grid["seed"]
    n_cells = 1
    for values in grid.values():
        n_cells *= len(values)
    assert prov["runs"] == n_cells  # every run of the grid finished and was read
    assert set(recipe["choices"]) == {k.split(".")[-1] for k in keys}


def test_the_bnn_recipe_applies_the_calibration_rule():
    """Among the candidates whose ±2σ validation coverage lies in [0.90, 0.99] on every run
    (every width and both variances), the lowest mean validation NLL: checked on the
    candidates the file lists."""
    recipe = _recipe("p2_bnn")
    assert recipe["provenance"]["require"] == [COVERAGE_RULE]
    candidates = recipe["groups"]["candidates"]
    eligible = [c for c in candidates if "excluded" not in c]
    assert eligible, "no setting meets the rule"
    best = min(eligible, key=lambda c: c["mean"])
    assert recipe["choices"] == best["values"]
    for c in candidates:
        if "excluded" in c:
            assert c["excluded"].startswith("val/coverage_2sigma of "), c


def test_the_defaults_read_the_recipe_files(compose_cfg):
    rho, bnn, diabetes = (_recipe(n)["choices"] for n in ("p2_rho", "p2_bnn", "p2_diabetes"))
    method = compose_cfg(["method=bnn"]).method
    assert method.rho_init == rho["rho_init"]
    assert (method.prior, method.kl_scale) == (bnn["prior"], bnn["kl_scale"])
    # the calibration and diabetes sweeps run under the chosen ρ₀
    for experiment in ("p2_calibration_select", "p2_diabetes_select", "p2_width_sweep"):
        assert compose_cfg([f"experiment={experiment}"]).method.rho_init == rho["rho_init"]
    reported = compose_cfg(["experiment=p2_diabetes"]).method
    assert (reported.prior, reported.kl_scale) == (diabetes["prior"], diabetes["kl_scale"])
    calibrated = compose_cfg(["experiment=p2_claims", "+p2_setup=calibrated"]).method
    assert (calibrated.prior, calibrated.kl_scale) == (bnn["prior"], bnn["kl_scale"])


def test_the_defaults_are_interpolations_not_typed_values():
    """A typed value would silently outlive a new selection: the files read the recipes."""
    method = yaml.safe_load((ROOT / "conf" / "method" / "bnn.yaml").read_text())
    assert method["rho_init"] == "${lookup.p2_rho.choices.rho_init}"
    assert method["prior"] == "${lookup.p2_bnn.choices.prior}"
    assert method["kl_scale"] == "${lookup.p2_bnn.choices.kl_scale}"
    diabetes = yaml.safe_load((ROOT / "conf" / "experiment" / "p2_diabetes.yaml").read_text())
    assert diabetes["method"]["kl_scale"] == "${lookup.p2_diabetes.choices.kl_scale}"


def test_make_p2_select_runs_the_three_sweeps_in_order_and_writes_each_recipe():
    makefile = (ROOT / "Makefile").read_text()
    body = re.search(r"^p2-select:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert body, "no p2-select target"
    lines = body.group(1).replace("\\\n", " ")
    order = [lines.index(f"experiment={e}") for e in SWEEPS]
    assert order == sorted(order)  # ρ₀ first: the others run under the chosen ρ₀
    for experiment, (name, _) in SWEEPS.items():
        command = _recipe(name)["provenance"]["command"].removeprefix("uqbench-select ")
        assert " ".join(command.split()) in " ".join(lines.split()), experiment


@pytest.mark.slow
def test_a_diabetes_selection_run_holds_validation_numbers_of_its_inner_rows_only(tmp_path):
    run_cli("experiment=p2_diabetes_select", "hydra.mode=RUN", "backbone.width=4",
            "method.variance=learned", "method.kl_scale=0.1", "seed=2", "trainer.epochs=2",
            "trainer.progress=false", "torch_threads=1", f"paths.runs_dir={tmp_path}")
    [found] = list(tmp_path.rglob("results.json"))
    res = json.loads(found.read_text())
    assert res["eval_splits"] == ["val"] and res["metrics"]
    assert all(k.startswith("val/") for k in res["metrics"]), sorted(res["metrics"])
    assert res["settings"]["dataset"]["fold"] == 2
    assert res["settings"]["dataset"]["sizes"]["val"] == 36  # ceil(0.1 · 354): fold 2 tests 88 rows
    assert not (found.parent / "predictions").exists()
