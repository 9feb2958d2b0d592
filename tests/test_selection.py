"""Choosing settings on the validation split from a sweep of finished runs, the recipe file it
writes (provenance, choices, candidates, ties, edges), the refusals (a sweep holding numbers
outside val/, a constraint no candidate meets), experiments reading the recipe, and the edge
marker that reaches the tables."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from tests.helpers import ROOT, run_cli
from uqbench.identity import differences
from uqbench.report.selection import GROUP_BY, TIE_TOLERANCE, main, select
from uqbench.runner.parts import recipes_used


def _run(backbone: str, method: str, lr: float | None, seed: int, nll: float,
         experiment: str = "grid", **metrics: float) -> dict:
    return {"experiment": experiment, "backbone": backbone, "seed": seed,
            "settings": {"trainer": {"optimizer": {"lr": lr}},
                         "backbone": {"name": backbone}, "method": {"name": method}},
            "metrics": {"val/nll": nll, **metrics}}


def _write(runs_dir: Path, runs: list[dict]) -> Path:
    for i, run in enumerate(runs):
        path = runs_dir / f"run{i}" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(run))
    return runs_dir


def _select(runs_dir: Path, *args: str, experiment: str = "grid") -> dict:
    """uqbench-select on a runs folder with --write; the recipe file it wrote."""
    out = runs_dir.parent / "recipe" / "chosen.yaml"
    assert main([experiment, "--runs", str(runs_dir), *args, "--write", str(out)]) == 0
    return yaml.safe_load(out.read_text())


# --- choosing ----------------------------------------------------------------------------------

def test_the_lowest_mean_validation_metric_wins_per_backbone_and_method():
    runs = [_run("a", "sve", 0.1, 0, 0.5), _run("a", "sve", 0.1, 1, 0.3),     # mean 0.4
            _run("a", "sve", 0.01, 0, 0.35), _run("a", "sve", 0.01, 1, 0.55),  # mean 0.45
            _run("a", "de", 0.001, 0, 0.2), _run("a", "de", 0.003, 0, float("nan")),
            _run("b", "sve", 0.1, 0, 0.9), _run("b", "sve", 0.01, 0, 0.8)]
    table = select(runs, ["trainer.optimizer.lr"], "val/nll")
    assert set(table) == {("a", "sve"), ("a", "de"), ("b", "sve")}
    sve = table[("a", "sve")]
    assert sve.best.values == (0.1,)
    assert [(c.values, c.mean, len(c.scores)) for c in sve.candidates] == [
        ((0.01,), pytest.approx(0.45), 2), ((0.1,), pytest.approx(0.4), 2)]
    assert [c.values for c in table[("a", "de")].candidates] == [(0.001,)]  # NaN: no candidate
    assert table[("b", "sve")].best.values == (0.01,)
    # --direction max picks the other end
    assert select(runs, ["trainer.optimizer.lr"], "val/nll", "max")[("a", "sve")].best.values \
        == (0.01,)


def test_several_keys_are_chosen_together():
    runs = [_run("a", "sve", 0.1, 0, 0.5), _run("a", "sve", 0.1, 0, 0.2)]
    runs[1]["settings"]["trainer"]["decay_to"] = "init"      # the other run leaves it unset
    table = select(runs, ["trainer.optimizer.lr", "trainer.decay_to"], "val/nll")
    assert table[("a", "sve")].best.values == (0.1, "init")


@pytest.mark.parametrize("nll,edge", [((0.5, 0.3, 0.4), []), ((0.3, 0.5, 0.4), ["lr"]),
                                      ((0.5, 0.4, 0.3), ["lr"])])
def test_a_numeric_choice_at_either_end_of_its_grid_is_an_edge(nll, edge):
    runs = [_run("a", "sve", lr, 0, v) for lr, v in zip((0.01, 0.1, 1.0), nll, strict=True)]
    for run in runs:  # a key with one value and a key of words are never at the edge
        run["settings"]["trainer"] |= {"decay_to": "zero", "epochs": 10}
    keys = ["trainer.optimizer.lr", "trainer.decay_to", "trainer.epochs"]
    assert select(runs, keys, "val/nll")[("a", "sve")].edge == edge


def test_the_group_by_paths_are_chosen_and_none_makes_one_group(tmp_path):
    runs = [_run("a", "sve", 0.1, 0, 0.5), _run("b", "de", 0.01, 0, 0.4)]
    runs[0]["variant"], runs[1]["variant"] = "x", "y"
    assert set(select(runs, ["trainer.optimizer.lr"], "val/nll", group_by=["variant"])) == {
        ("x",), ("y",)}
    recipe = _select(_write(tmp_path / "runs", runs), "--group-by", "none")
    assert recipe["choices"] == {"lr": 0.01} and recipe["groups"]["edge"] == ["lr"]
    assert recipe["provenance"]["group_by"] == []


def test_a_tie_within_the_tolerance_goes_to_the_smallest_values(tmp_path, capsys):
    near = 0.4 * (1 + TIE_TOLERANCE / 2)   # within 1e-9 relative of 0.4: a tie
    far = 0.4 * (1 + 20 * TIE_TOLERANCE)   # beyond it: no tie
    runs = [_run("a", "sve", 0.3, 0, 0.4), _run("a", "sve", 0.1, 0, near),
            _run("a", "sve", 0.03, 0, far), _run("a", "sve", 0.01, 0, 0.9)]
    recipe = _select(_write(tmp_path / "runs", runs))
    assert recipe["choices"] == {"a": {"sve": {"lr": 0.1}}}   # 0.1 < 0.3, the tied ones
    ties = recipe["groups"]["a"]["sve"]["ties"]
    assert ties["tied"] == [{"lr": 0.1}, {"lr": 0.3}] and "smallest" in ties["broken_by"]
    assert "1e-09 relative" in recipe["provenance"]["tie_rule"]
    assert "tie of 2" in capsys.readouterr().out


def test_a_group_without_a_tie_records_none(tmp_path):
    recipe = _select(_write(tmp_path / "runs", [_run("a", "sve", 0.1, 0, 0.4),
                                                _run("a", "sve", 0.3, 0, 0.5)]))
    assert recipe["groups"]["a"]["sve"]["ties"] is None


def test_require_excludes_a_candidate_and_says_why(tmp_path):
    runs = [_run("a", "sve", 0.1, 0, 0.3, **{"val/coverage_2sigma": 0.80}),   # best, too low
            _run("a", "sve", 0.1, 1, 0.3, **{"val/coverage_2sigma": 0.84}),
            _run("a", "sve", 0.03, 0, 0.4, **{"val/coverage_2sigma": 0.95}),
            _run("a", "sve", 0.01, 0, 0.5, **{"val/coverage_2sigma": 0.93})]
    recipe = _select(_write(tmp_path / "runs", runs),
                     "--require", "val/coverage_2sigma=0.90:0.99")
    assert recipe["choices"] == {"a": {"sve": {"lr": 0.03}}}
    assert recipe["provenance"]["require"] == ["val/coverage_2sigma=0.9:0.99"]
    excluded = {c["values"]["lr"]: c.get("excluded")
                for c in recipe["groups"]["a"]["sve"]["candidates"]}
    assert excluded == {0.01: None, 0.03: None,
                        0.1: "val/coverage_2sigma mean 0.82 outside [0.9, 0.99]"}


def test_a_group_with_no_eligible_candidate_is_an_error_naming_it(tmp_path, capsys):
    runs = [_run("a", "sve", 0.1, 0, 0.3, **{"val/coverage_2sigma": 0.5}),
            _run("b", "sve", 0.1, 0, 0.3, **{"val/coverage_2sigma": 0.95})]
    out = tmp_path / "recipe.yaml"
    with pytest.raises(SystemExit) as exit_:
        main(["grid", "--runs", str(_write(tmp_path / "runs", runs)), "--require",
              "val/coverage_2sigma=0.9:0.99", "--write", str(out)])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "error: group a/sve: no candidate meets val/coverage_2sigma=0.9:0.99" in err
    assert "lr=0.1: val/coverage_2sigma mean 0.5 outside [0.9, 0.99]" in err
    assert not out.exists()


def test_a_sweep_holding_a_test_metric_is_refused_and_nothing_written(tmp_path, capsys):
    runs = [_run("a", "sve", 0.1, 0, 0.3), _run("a", "sve", 0.3, 0, 0.4, **{"test/nll": 0.5})]
    out = tmp_path / "recipe.yaml"
    with pytest.raises(SystemExit) as exit_:
        main(["grid", "--runs", str(_write(tmp_path / "runs", runs)), "--write", str(out)])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: refusing to select from experiment 'grid': 1 of its runs "
                          "hold metrics outside the validation split")
    assert f"{tmp_path / 'runs' / 'run1' / 'results.json'}: test/nll" in err
    assert not out.exists()


def test_no_runs_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nothing", "--runs", str(tmp_path)])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("error: no runs of experiment 'nothing'")


# --- a real selection sweep through the CLI ----------------------------------------------------

SWEEP = "tiny_select"
LRS = (0.001, 0.01)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """2 learning rates × 2 seeds of a tiny model, scored on the validation split only."""
    runs = tmp_path_factory.mktemp("runs")
    run_cli("-m", f"experiment_name={SWEEP}", "backbone=tiny_vit", "dataset=fake_images",
            "method=single", "eval_splits=[val]", f"trainer.optimizer.lr={','.join(map(str, LRS))}",
            "seed=0,1", "trainer.epochs=1", "trainer.progress=false", "logger=none", "plot=false",
            "torch_threads=1", f"paths.runs_dir={runs}")
    return runs


def test_the_sweep_holds_validation_numbers_only(sweep):
    files = sorted(sweep.rglob("results.json"))
    assert len(files) == len(LRS) * 2
    for path in files:
        res = json.loads(path.read_text())
        assert res["eval_splits"] == ["val"] and res["metrics"]
        assert [k for k in res["metrics"] if not k.startswith("val/")] == []
        assert sorted(p.name for p in (path.parent / "predictions").iterdir()) == ["val.npz"]


def test_the_recipe_records_its_provenance_and_every_candidate(sweep, tmp_path, capsys):
    out = tmp_path / "recipe" / "tiny.yaml"
    argv = [SWEEP, "--runs", str(sweep), "--key", "trainer.optimizer.lr", "--metric", "val/nll",
            "--write", str(out)]
    assert main(argv) == 0
    recipe = yaml.safe_load(out.read_text())
    # the hand computation: each learning rate's val/nll values, read from the files
    scores: dict[float, list[float]] = {}
    for path in sweep.rglob("results.json"):
        res = json.loads(path.read_text())
        scores.setdefault(res["settings"]["trainer"]["optimizer"]["lr"], []).append(
            res["metrics"]["val/nll"])
    assert sorted(scores) == list(LRS) and all(len(v) == 2 for v in scores.values())
    best = min(scores, key=lambda lr: np.mean(scores[lr]))
    provenance = recipe["provenance"]
    assert (provenance["sweep"], provenance["metric"], provenance["direction"]) == (
        SWEEP, "val/nll", "min")
    assert provenance["seeds"] == [0, 1] and provenance["runs"] == 4
    assert provenance["grid"] == {"tiny_vit": {"single": {"lr": list(LRS)}}}
    assert provenance["keys"] == {"lr": "trainer.optimizer.lr"}
    assert provenance["command"].startswith(f"uqbench-select {SWEEP} --runs")
    assert provenance["file"] == str(out)
    assert recipe["choices"] == {"tiny_vit": {"single": {"lr": best}}}
    group = recipe["groups"]["tiny_vit"]["single"]
    for candidate in group["candidates"]:
        values = np.array(scores[candidate["values"]["lr"]])
        assert candidate["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert candidate["std"] == pytest.approx(values.std(ddof=1), rel=1e-12)
        assert candidate["n"] == 2
    # with two values, either choice is the smallest or the largest of the grid
    assert group["edge"] == (["lr"] if best in (min(LRS), max(LRS)) else [])
    captured = capsys.readouterr()
    assert "tiny_vit:\n  single: {lr: " in captured.out
    assert f"warning: tiny_vit/single: lr={best:g} is the" in captured.err
    # an experiment reads it as a lookup table
    node = OmegaConf.create({"lookup": {"t": OmegaConf.load(out)},
                             "lr": "${lookup.t.choices.tiny_vit.single.lr}"})
    assert node.lr == best


def test_the_sweep_with_one_scoring_on_test_is_refused(sweep, tmp_path, capsys):
    """A scoring of one sweep run on every split (a test number within reach of the choice)
    makes the whole sweep ineligible."""
    copied = tmp_path / "runs"
    shutil.copytree(sweep, copied)
    first = sorted(copied.rglob("results.json"))[0]
    res = json.loads(first.read_text())
    res["metrics"]["test/nll"] = 1.0
    first.write_text(json.dumps(res))
    with pytest.raises(SystemExit):
        main([SWEEP, "--runs", str(copied), "--write", str(tmp_path / "r.yaml")])
    assert "refusing to select" in capsys.readouterr().err
    assert not (tmp_path / "r.yaml").exists()


# --- experiments read the recipe file ----------------------------------------------------------

RECIPE = ROOT / "conf" / "recipe" / "p1_digits_first.yaml"  # the first protocol's


def _swept(compose_cfg, experiment: str, key: str) -> list[str]:
    """The values an experiment's sweep lists for ``key`` (its one list of them)."""
    cfg = compose_cfg([f"experiment={experiment}"], return_hydra_config=True)
    return str(cfg.hydra.sweeper.params[key]).split(",")


@pytest.mark.slow  # composes every backbone × method of the sweep
def test_p1_digits_reads_each_learning_rate_from_the_recipe_file(compose_cfg):
    choices = yaml.safe_load(RECIPE.read_text())["choices"]
    for backbone in _swept(compose_cfg, "p1_digits_first", "backbone"):
        for method in _swept(compose_cfg, "p1_digits_first", "method"):
            cfg = compose_cfg(["experiment=p1_digits_first", f"backbone={backbone}",
                               f"method={method}"])
            entry = choices[backbone][cfg.method.name]
            assert cfg.trainer.optimizer.lr == entry["lr"], (backbone, method)
            assert cfg.trainer.decay_to == entry.get("decay_to"), (backbone, method)


@pytest.mark.parametrize("method,low,high,decay", [
    (None, 1e-4, 1e-2, "null"),                # full fine-tuning (the default sweep)
    ("lora_ensemble", 3e-4, 3e-2, "null"),
    ("sve", 1e-2, 1.0, "zero,init"), ("svf", 1e-2, 1.0, "zero,init")])
def test_the_first_selection_sweep_takes_its_family_grid_and_scores_val_only(compose_cfg, method,
                                                                             low, high, decay):
    cfg = compose_cfg(["experiment=p1_digits_first_select",
                       *([f"method={method}"] if method else [])],
                      return_hydra_config=True)
    assert list(cfg.eval_splits) == ["val"]
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True)
    lrs = [float(v) for v in params["trainer.optimizer.lr"].split(",")]
    assert len(lrs) == 5 and (lrs[0], lrs[-1]) == pytest.approx((low, high))
    steps = np.log10(np.array(lrs[1:]) / np.array(lrs[:-1]))  # about half a decade each
    assert np.all(np.abs(steps - 0.5) < 0.03)
    assert params["trainer.decay_to"] == decay
    # it chooses for every backbone level the benchmark runs
    assert set(_swept(compose_cfg, "p1_digits_first", "backbone")) <= set(
        params["backbone"].split(","))


def test_the_selection_sweep_gives_every_method_the_same_three_candidates(compose_cfg):
    """One tuning budget: every method and level of experiment=p1_digits gets 5 learning rates,
    half a decade apart, and nothing else is swept; it scores validation only."""
    swept = {k: _swept(compose_cfg, "p1_digits", k) for k in ("backbone", "method")}
    select = compose_cfg(["experiment=p1_digits_select"], return_hydra_config=True)
    params = OmegaConf.to_container(select.hydra.sweeper.params, resolve=True)
    assert set(params) == {"backbone", "method", "grid_point", "seed"}
    points = ["lowest", "low", "mid", "high", "highest"]
    assert params["grid_point"].split(",") == points and str(params["seed"]) == "0"
    assert set(params["backbone"].split(",")) == set(swept["backbone"])
    assert set(params["method"].split(",")) == set(swept["method"])
    for method in swept["method"]:
        lrs = []
        for point in points:
            cfg = compose_cfg(["experiment=p1_digits_select", f"method={method}",
                               f"grid_point={point}"])
            assert list(cfg.eval_splits) == ["val"] and cfg.trainer.decay_to is None
            lrs.append(float(cfg.trainer.optimizer.lr))
        steps = np.log10(np.array(lrs[1:]) / np.array(lrs[:-1]))
        assert np.all(np.abs(steps - 0.5) < 0.03), (method, lrs)


def test_the_recipe_is_no_part_of_a_runs_identity(compose_cfg):
    """A re-selection that picks the same values (new provenance, new scores) leaves the runs
    reusable; one that picks another value changes the runs that read it."""
    cfg = OmegaConf.to_container(compose_cfg(["experiment=p1_digits_first", "method=svf"]),
                                 resolve=True)
    backbone, lr = cfg["backbone"]["name"], cfg["trainer"]["optimizer"]["lr"]
    again = copy.deepcopy(cfg)
    again["lookup"]["digits_recipe"]["provenance"] |= {"date": "2030-01-01", "runs": 120}
    again["lookup"]["digits_recipe"]["groups"][backbone]["svf"] = {
        "candidates": [{"values": {"lr": lr}, "mean": 0.1, "std": None, "n": 1}],
        "ties": None, "edge": ["lr"]}
    assert differences(cfg, again) == []
    moved = copy.deepcopy(cfg)
    moved["trainer"]["optimizer"]["lr"] = 3 * lr  # what the run reads from a changed choice
    assert differences(cfg, moved) == [
        f"trainer.optimizer.lr: {lr!r} (stored) → {3 * lr!r} (requested)"]


def _settings(backbone: str, method: str, lr: float, decay_to: str | None) -> dict:
    return {"settings": {"backbone": {"name": backbone}, "method": {"name": method},
                         "trainer": {"optimizer": {"lr": lr}, "decay_to": decay_to}}}


def test_a_run_records_the_recipe_entry_it_used_with_its_edge_keys():
    recipe = {"provenance": {"file": "conf/recipe/x.yaml", "group_by": GROUP_BY,
                             "keys": {"lr": "trainer.optimizer.lr",
                                      "decay_to": "trainer.decay_to"}},
              "choices": {"b": {"svf": {"lr": 0.3, "decay_to": "zero"}, "sve": {"lr": 0.1}}},
              "groups": {"b": {"svf": {"edge": ["lr"]}, "sve": {"edge": []}}}}
    config = {"lookup": {"r": recipe, "plain": {"b": {"lr": 0.3}}}}  # no provenance: no recipe
    assert recipes_used(config, _settings("b", "svf", 0.3, "zero")) == {
        "r": {"file": "conf/recipe/x.yaml", "group": ["b", "svf"],
              "choices": {"lr": 0.3, "decay_to": "zero"}, "edge": ["lr"]}}
    assert recipes_used(config, _settings("b", "sve", 0.1, None))["r"]["edge"] == []
    # a run that set its own value, or of a group the recipe lacks, used no entry
    assert recipes_used(config, _settings("b", "svf", 0.2, "zero")) == {}
    assert recipes_used(config, _settings("b", "svf", 0.3, "init")) == {}
    assert recipes_used(config, _settings("c", "svf", 0.3, "zero")) == {}


def test_a_p1_digits_run_records_its_entry_of_the_recipe_file(compose_cfg):
    recipe = yaml.safe_load(RECIPE.read_text())
    cfg = compose_cfg(["experiment=p1_digits_first", "method=svf"])
    config = OmegaConf.to_container(cfg, resolve=True)
    backbone = str(cfg.backbone.name)
    chosen = recipe["choices"][backbone]["svf"]
    used = recipes_used(config, _settings(backbone, "svf", chosen["lr"], chosen.get("decay_to")))
    assert used == {"digits_recipe": {"file": "conf/recipe/p1_digits_first.yaml",
                                      "group": [backbone, "svf"], "choices": chosen,
                                      "edge": recipe["groups"][backbone]["svf"]["edge"]}}


def test_a_row_whose_runs_used_an_edge_choice_is_marked_with_a_footnote(tmp_path):
    from uqbench.report.tables import write_tables

    spec = {"title": "edges", "rows": [{"key": "method", "title": "method"}],
            "columns": [{"key": "metrics.test/nll", "title": "NLL", "fmt": ".3f"}]}
    edge = {"digits_recipe": {"file": "conf/recipe/p1_digits.yaml", "group": ["b", "svf"],
                              "choices": {"lr": 0.3}, "edge": ["lr"]}}
    runs = [{"experiment": "edged", "method": "svf", "seed": 0, "recipe": edge,
             "metrics": {"test/nll": 0.5}, "table": spec},
            {"experiment": "edged", "method": "sve", "seed": 0, "recipe": {},
             "metrics": {"test/nll": 0.4}, "table": spec}]
    written = write_tables(_write(tmp_path / "runs", runs), tmp_path / "tables", "edged")
    md = written["edged"].read_text()
    assert "| svf †    |" in md and "| sve      |" in md
    assert md.rstrip().endswith("† chosen at the edge of its grid: lr")
    tex = tmp_path / "tables" / "edged.tex"
    assert r"svf \dag{}" in tex.read_text() and r"\dag{} chosen at the edge" in tex.read_text()
    from tests.test_tables_latex import compile_tex

    compile_tex([tex], tmp_path / "latex")  # the marker is LaTeX pdflatex reads
