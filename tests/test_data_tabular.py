"""Tabular regression data (uqbench/data/tabular.py): diabetes and CSV tables in k folds."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm
from sklearn.datasets import load_diabetes
from sklearn.model_selection import KFold
from sklearn.preprocessing import StandardScaler

from tests.helpers import run_cli
from uqbench.data.tabular import TabularRegressionData

N_DIABETES = 442


@pytest.fixture(scope="module")
def raw():
    """scikit-learn's diabetes set as recorded: features (442, 10), target (442,)."""
    bunch = load_diabetes(scaled=False)
    return bunch.data.astype(np.float64), bunch.target.astype(np.float64)


def _tensors(data, split):
    x, y = data.dataset(split).tensors
    return x.numpy().astype(np.float64), y.numpy().astype(np.float64)


def write_csv(path, header, rows):
    """A real CSV file (csv module: quoted header fields, CRLF line ends)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_NONNUMERIC)
        writer.writerow(header)
        writer.writerows(rows)
    return path


# --- diabetes: size, folds ----------------------------------------------------------------------

def test_diabetes_loads_offline_with_442_rows_and_10_features():
    data = TabularRegressionData()
    x, y = data.dataset("train").tensors
    assert x.dtype == y.dtype == torch.float32
    assert x.shape[1] == 10 and y.shape[1] == 1 and y.dim() == 2
    assert sum(len(data.dataset(s)) for s in ("train", "val", "test")) == N_DIABETES
    info = data.info
    assert (info.task, info.in_dim, info.out_dim) == ("regression", 10, 1)
    # 442 rows in 5 folds: 89, 89, 88, 88, 88; fold 0's other 353 rows: ceil(35.3) = 36 val
    assert data.settings()["sizes"] == {"train": 317, "val": 36, "test": 89}
    assert info.num_train_batches == math.ceil(317 / 32)
    assert (data.eval_splits, data.ood_splits) == (("test",), ())


def test_test_folds_are_sklearns_kfold_and_partition_the_rows():
    expected = list(KFold(5, shuffle=True, random_state=0).split(np.arange(N_DIABETES)))
    seen = []
    for fold in range(5):
        splits = TabularRegressionData(fold=fold).indices
        np.testing.assert_array_equal(splits["test"], np.sort(expected[fold][1]))
        parts = [splits[s] for s in ("train", "val", "test")]
        # disjoint and covering within the fold
        assert sum(len(p) for p in parts) == N_DIABETES
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(N_DIABETES))
        assert len(splits["val"]) == math.ceil(0.1 * (N_DIABETES - len(splits["test"])))
        seen.append(splits["test"])
    # the five test folds are disjoint and cover every row once
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(N_DIABETES))
    assert [len(s) for s in seen] == [89, 89, 88, 88, 88]


def test_val_rows_are_an_inner_split_of_each_outer_folds_training_rows():
    """p2_diabetes_select scores the inner validation rows: for outer fold k they come from the
    other four folds (the rows fold k trains on) and never from fold k's test rows. The folds
    are recomputed here with scikit-learn alone."""
    tests = [np.sort(t) for _, t in KFold(5, shuffle=True, random_state=0)
             .split(np.arange(N_DIABETES))]
    vals = []
    for fold in range(5):
        splits = TabularRegressionData(fold=fold).indices
        val = splits["val"]
        assert len(val) == math.ceil(0.1 * (N_DIABETES - len(tests[fold])))
        assert len(np.unique(val)) == len(val)
        assert np.intersect1d(val, tests[fold]).size == 0          # never the outer test fold
        assert np.intersect1d(val, splits["train"]).size == 0      # nor a row it trains on
        others = np.concatenate([tests[j] for j in range(5) if j != fold])
        assert np.isin(val, others).all()                          # only the training folds
        # by design every val row is another fold's test row: spread over all four of them
        assert {j for j in range(5) if j != fold and np.isin(val, tests[j]).any()} == \
            {j for j in range(5) if j != fold}
        vals.append(val)
    # each outer fold draws its own inner rows (not one val set for every fold)
    assert len({tuple(v) for v in vals}) == 5


def test_splits_are_fixed_by_split_seed():
    a, b = TabularRegressionData(fold=2).indices, TabularRegressionData(fold=2).indices
    for split in a:
        np.testing.assert_array_equal(a[split], b[split])
    other = TabularRegressionData(fold=2, split_seed=1).indices
    assert not np.array_equal(a["test"], other["test"])


def test_standardisation_uses_the_training_split_only(raw):
    x_raw, y_raw = raw
    data = TabularRegressionData(fold=3)
    idx = data.indices
    mu, sd = x_raw[idx["train"]].mean(0), x_raw[idx["train"]].std(0)
    y_mu, y_sd = y_raw[idx["train"]].mean(), y_raw[idx["train"]].std()
    scaler = StandardScaler().fit(x_raw[idx["train"]])  # an independent implementation
    for split in ("train", "val", "test"):
        x, y = _tensors(data, split)
        np.testing.assert_allclose(x, (x_raw[idx[split]] - mu) / sd, atol=1e-5)
        np.testing.assert_allclose(x, scaler.transform(x_raw[idx[split]]), atol=1e-5)
        np.testing.assert_allclose(y[:, 0], (y_raw[idx[split]] - y_mu) / y_sd, atol=1e-5)
    # statistics of all rows would give other values: the check above can tell them apart
    x_test, _ = _tensors(data, "test")
    all_rows = (x_raw[idx["test"]] - x_raw.mean(0)) / x_raw.std(0)
    assert np.abs(x_test - all_rows).max() > 1e-2
    settings = data.settings()
    assert settings["target_mean"] == pytest.approx(y_mu, rel=1e-12)
    assert settings["target_std"] == pytest.approx(y_sd, rel=1e-12)
    assert settings["target_std"] == pytest.approx(77.0, abs=2.0)  # diabetes' target: std ≈ 77
    assert (settings["folds"], settings["fold"], settings["split_seed"]) == (5, 3, 0)


# --- CSV tables ---------------------------------------------------------------------------------

def test_a_csv_file_loads_with_its_target_column(tmp_path):
    x1 = np.arange(10, dtype=np.float64)
    y = np.array([0.5, 2.0, 1.5, 4.0, 3.5, 6.0, 5.5, 8.0, 7.5, 10.0])
    rows = [[float(a), 7.25, float(t), float(a) ** 2] for a, t in zip(x1, y, strict=True)]
    path = write_csv(tmp_path / "houses.csv", ["x1", "flat", "price", "x 3"], rows)
    assert path.read_bytes().startswith(b'"x1","flat","price","x 3"\r\n')  # a real CSV
    data = TabularRegressionData(name="houses", source=str(path), target="price", folds=5,
                                 fold=1)
    assert data.info.in_dim == 3
    idx = data.indices
    # 10 rows, 5 folds: test 2; the other 8: ceil(0.8) = 1 val, 7 train
    assert {s: len(v) for s, v in idx.items()} == {"train": 7, "val": 1, "test": 2}
    features = np.stack([x1, np.full(10, 7.25), x1 ** 2], axis=1)
    train = idx["train"]
    for split in ("train", "val", "test"):
        x, t = _tensors(data, split)
        np.testing.assert_allclose(t[:, 0], (y[idx[split]] - y[train].mean()) / y[train].std(),
                                   atol=1e-6)
        for j in (0, 2):
            col = features[:, j]
            np.testing.assert_allclose(
                x[:, j], (col[idx[split]] - col[train].mean()) / col[train].std(), atol=1e-5)
        # the constant column: centred and not scaled, exactly 0
        assert np.all(x[:, 1] == 0.0)
    s = data.settings()
    assert (s["target"], s["features"], s["rows"]) == ("price", 3, 10)
    assert s["constant_features"] == ["flat"]


@pytest.fixture
def small_csv():
    """The lines of a valid 10-row CSV (a, b, y), to be spoiled by each bad-input case."""
    lines = ["a,b,y"] + [f"{i},{i % 3},{2 * i + (i % 2)}" for i in range(10)]
    return lines


def _bad_csv(tmp_path, lines, edit):
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(edit(list(lines))) + "\n")
    return str(path)


def _set(lines, i, text):
    lines[i] = text
    return lines


CSV_CASES = {
    # name: (edit of the lines, constructor kwargs, words the message must hold)
    "nan target": (lambda ls: _set(_set(ls, 4, "3,0,nan"), 8, "7,1,"), {},
                   ["2 target value(s)", "row 3", "line 5", "['y']"]),
    "blank lines keep line numbers": (lambda ls: _set(ls[:2] + [""] + ls[2:], 5, "3,0,nan"),
                                      {}, ["1 target value(s)", "row 3", "line 6"]),
    "row of empty cells": (lambda ls: _set(ls, 9, ",,"), {},
                           ["1 target value(s)", "row 8", "line 10"]),
    "inf feature": (lambda ls: _set(ls, 2, "1,inf,3"), {},
                    ["1 feature value(s)", "row 1", "line 3", "['b']"]),
    "constant target": (lambda ls: [ls[0]] + [f"{i},{i % 3},4.5" for i in range(10)], {},
                        ["target 'y' is constant", "4.5"]),
    "missing target column": (lambda ls: ls, {"target": "price"},
                              ["'price' is not a column", "'a', 'b', 'y'"]),
    "no target given": (lambda ls: ls, {"target": None}, ["dataset.target is not set", "'y'"]),
    "header only": (lambda ls: ls[:1], {}, ["no data rows", "a, b, y"]),
    "empty file": (lambda ls: [], {}, ["is empty", "header row"]),
    "non-numeric": (lambda ls: _set(ls, 3, "two,2,5"), {},
                    ["1 value(s) are not numbers", "line 4", "column 'a'", "'two'"]),
    "ragged row": (lambda ls: _set(ls, 6, "5,2"), {}, ["line 7", "2 values", "3 columns"]),
    "duplicate column": (lambda ls: _set(ls, 0, "a,a,y"), {}, ["['a']", "twice"]),
    "only the target": (lambda ls: ["y"] + [str(i) for i in range(10)], {},
                        ["only the target column", "at least one feature"]),
    "too few rows left to train": (lambda ls: ls, {"val_fraction": 0.9},
                                   ["val_fraction=0.9", "leaves 0 of the 8", "at least 2"]),
    "folds above rows": (lambda ls: ls, {"folds": 11}, ["dataset.folds=11", "10 rows"]),
}


@pytest.mark.parametrize("case", list(CSV_CASES))
def test_bad_csv_input_is_refused_naming_the_value(tmp_path, small_csv, case):
    edit, kwargs, words = CSV_CASES[case]
    source = _bad_csv(tmp_path, small_csv, edit)
    with pytest.raises(ValueError) as err:
        TabularRegressionData(source=source, **{"target": "y", **kwargs})
    for word in words:
        assert word in str(err.value), str(err.value)


def test_the_valid_small_csv_loads(tmp_path, small_csv):
    """The bad-input cases above are each one change away from this table."""
    data = TabularRegressionData(source=_bad_csv(tmp_path, small_csv, lambda ls: ls),
                                 target="y")
    assert {s: len(v) for s, v in data.indices.items()} == {"train": 7, "val": 1, "test": 2}


@pytest.mark.parametrize("kwargs,words", [
    ({"source": "boston"}, ["'boston'", "diabetes", ".csv"]),
    ({"folds": 1}, ["dataset.folds=1", "at least 2"]),
    ({"folds": 1000}, ["dataset.folds=1000", "442 rows"]),
    ({"fold": 5}, ["dataset.fold=5", "[0, 5)", "0 … 4"]),
    ({"fold": -1}, ["dataset.fold=-1", "[0, 5)"]),
    ({"val_fraction": 0.0}, ["dataset.val_fraction=0.0", "(0, 1)"]),
    ({"val_fraction": 1.0}, ["dataset.val_fraction=1.0", "(0, 1)"]),
    ({"target": "bmi"}, ["dataset.target='bmi'", "diabetes"]),
])
def test_bad_settings_are_refused_naming_the_value(kwargs, words):
    with pytest.raises(ValueError) as err:
        TabularRegressionData(**kwargs)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_a_missing_csv_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file .*nowhere.csv"):
        TabularRegressionData(source=str(tmp_path / "nowhere.csv"), target="y")


# --- through the CLI ----------------------------------------------------------------------------

def _nan_target_csv(tmp_path):
    rows = [[float(i), float(i % 3), float(2 * i)] for i in range(20)]
    rows[4][2] = math.nan
    return write_csv(tmp_path / "nan.csv", ["a", "b", "y"], rows)


@pytest.mark.parametrize("case", ["nan target csv", "folds above rows"])
def test_cli_refuses_bad_data_before_the_run_starts(tmp_path, case):
    runs = tmp_path / "runs"
    if case == "nan target csv":
        args = [f"dataset.source={_nan_target_csv(tmp_path)}", "dataset.target=y"]
        words = ["1 target value(s)", "row 4", "line 6"]
    else:
        args, words = ["dataset.folds=1000"], ["dataset.folds=1000", "442 rows"]
    proc = run_cli("dataset=diabetes", *args, "trainer.progress=false", "logger=none",
                   f"paths.runs_dir={runs}", check=False)
    assert proc.returncode == 1
    for word in words:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # nothing is left: no lock, no stage, no config.yaml, results.json or log, no folder
    assert not runs.exists() or list(runs.iterdir()) == []


def test_cli_p2_diabetes_run_scores_the_test_fold(tmp_path, raw):
    run_cli("experiment=p2_diabetes", "backbone.width=4", "method.variance=learned", "seed=1",
            "trainer.epochs=3", "trainer.progress=false", f"paths.runs_dir={tmp_path}")
    found = list(tmp_path.rglob("results.json"))
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "p2_diabetes/diabetes/bnn_learned/mlp_w4/trainer.epochs=3/seed1/results.json"]
    res = json.loads(found[0].read_text())
    m = res["metrics"]
    assert math.isfinite(m["test/nll"]) and math.isfinite(m["test/rmse"])
    assert not any(k.startswith("ood/") for k in m)
    ds = res["settings"]["dataset"]
    assert ds["fold"] == 1  # dataset.fold follows the seed
    assert ds["sizes"] == {"train": 317, "val": 36, "test": 89}
    # the predictions are of fold 1's rows in standardised units: recompute from sklearn
    _, y_raw = raw
    _, test = list(KFold(5, shuffle=True, random_state=0).split(y_raw))[1]
    p = np.load(found[0].parent / "predictions" / "test.npz")
    assert p["y"].shape == (89, 1)
    # y standardised with train statistics → its values, in order, are y_raw[test]'s
    y = p["y"][:, 0].astype(np.float64) * ds["target_std"] + ds["target_mean"]
    np.testing.assert_allclose(y, y_raw[np.sort(test)], atol=1e-3)
    mu, sd = p["mean"].astype(np.float64), np.sqrt(p["var"].astype(np.float64))
    assert m["test/nll"] == pytest.approx(-norm.logpdf(p["y"], mu, sd).mean(), rel=1e-5)
    assert m["test/rmse"] == pytest.approx(math.sqrt(((p["y"] - mu) ** 2).mean()), rel=1e-5)
