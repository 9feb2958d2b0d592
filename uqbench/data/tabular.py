"""Real tabular regression data, cut into k folds: the P2 comparison beyond the polynomial.

Sources (``source``):

- ``diabetes``: scikit-learn's bundled diabetes set (``sklearn.datasets.load_diabetes``, no
  download): 442 patients, 10 baseline features (age, sex, bmi, bp, s1–s6, read unscaled), the
  target a measure of disease progression one year later.
- a path to a ``.csv`` file with a header row: ``target`` names the target column, every other
  column is a feature. Every value must be a number; an empty cell counts as missing.

Splits: the rows are shuffled once by ``split_seed`` (fixed, independent of the model seed) and
cut into ``folds`` folds (scikit-learn's ``KFold(folds, shuffle=True,
random_state=split_seed)``). ``test`` is fold ``fold``; the other folds are the training part,
of which ``ceil(val_fraction · n)`` rows (drawn with ``split_seed``) are ``val`` and the rest
``train``. Over ``fold = 0 … folds-1`` the test splits are disjoint and cover every row. No OOD
split. ``val`` is an inner validation split: rows of the training folds only, never of the test
fold, so a choice made on it (experiment ``p2_diabetes_select``, which scores val alone) has
seen no row that fold is tested on.

Standardisation: features and target are standardised with the mean and standard deviation
(ddof=0) of the ``train`` split only, so no statistic of val or test leaks into the model; all
metrics (NLL, RMSE, σ) are therefore in standardised target units. ``settings()`` records the
target's mean and std: y = mean + std · y_std, RMSE and σ scale by std, and an NLL converts as
NLL_original = NLL_standardised + log(std). A feature constant on the training split is centred
and not scaled (its std is taken as 1, as scikit-learn's StandardScaler does): it is 0 on every
training row, and on val/test rows it shows only how far they are from that constant.

Tensors: inputs (N, d) and targets (N, 1), float32.

Every check on the data (finite values, a non-constant target, fold and fraction settings) runs
when the datamodule is built, which the runner does before it writes anything
(:meth:`TabularRegressionData.check_settings`).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from uqbench.contracts import DataInfo, InputBackbone
from uqbench.data.base import DataModule, check_modality

SOURCES = ("diabetes",)  # bundled sources; any path ending in .csv works too
SPLITS = ("train", "val", "test")
SOURCE_HINT = f"one of: {', '.join(SOURCES)}, or a path to a .csv file with a header row"


@dataclass(frozen=True)
class Table:
    """A regression table: features (N, d) and targets (N,), both float64, with column names."""

    features: np.ndarray
    targets: np.ndarray
    feature_names: tuple[str, ...]
    target_name: str
    origin: str                          # where the rows come from, for error messages
    lines: tuple[int, ...] | None = None  # each row's line in its file (None: not a file)

    def row_place(self, row: int) -> str:
        """How a user finds row ``row`` (0-based) of this table."""
        if self.lines is not None:
            return f"row {row} (0-based, header not counted; line {self.lines[row]})"
        return f"row {row} (0-based)"


# --- loading ------------------------------------------------------------------------------------

def load_table(source: str, target: str | None) -> Table:
    """The table ``source`` names: a bundled set or a CSV path (then ``target`` is its target
    column). Raises ValueError for an unknown source, FileNotFoundError for a missing file."""
    if source == "diabetes":
        if target not in (None, "target"):
            raise ValueError(f"dataset.target='{target}' but source 'diabetes' has one target "
                             f"(disease progression); drop dataset.target (set it to null)")
        return diabetes_table()
    if str(source).lower().endswith(".csv"):
        return read_csv_table(Path(source).expanduser(), target)
    raise ValueError(f"unknown dataset.source '{source}'; valid: {SOURCE_HINT} (e.g. "
                     f"dataset.source=/data/houses.csv dataset.target=price)")


def diabetes_table() -> Table:
    """scikit-learn's diabetes set, unscaled: 442 rows × 10 features (age, sex, bmi, bp,
    s1–s6) and the disease progression target."""
    from sklearn.datasets import load_diabetes

    # scaled=False: the recorded values; ours is the only standardisation (training rows only,
    # where the bundled scaled copy uses statistics of all 442 rows)
    bunch = load_diabetes(scaled=False)
    return Table(np.asarray(bunch.data, dtype=np.float64),
                 np.asarray(bunch.target, dtype=np.float64),
                 tuple(bunch.feature_names), "target", "scikit-learn's diabetes set")


def read_csv_table(path: Path, target: str | None) -> Table:
    """A CSV file with a header row → Table; ``target`` names the target column, every other
    column is a feature. Empty cells become NaN (reported by :func:`check_finite`)."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset.source: no such file {path.absolute()}; valid: "
                                f"{SOURCE_HINT}")
    with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
        # a blank line is no row; a line of empty cells (",,") is a row of missing values
        lines = [(n, row) for n, row in enumerate(csv.reader(f), start=1)
                 if len(row) > 1 or (row and row[0].strip())]
    if not lines:
        raise ValueError(f"dataset.source {path} is empty: it needs a header row and data rows")
    header = [name.strip() for name in lines[0][1]]
    check_header(header, path, target)
    rows = lines[1:]
    if not rows:
        raise ValueError(f"dataset.source {path} has a header ({', '.join(header)}) but no "
                         f"data rows")
    values = parse_numbers(rows, header, path)  # (N, columns)
    t = header.index(str(target))
    keep = [j for j in range(len(header)) if j != t]
    return Table(values[:, keep], values[:, t], tuple(header[j] for j in keep), str(target),
                 f"dataset.source {path}", lines=tuple(line for line, _ in rows))


def check_header(header: list[str], path: Path, target: str | None) -> None:
    """Distinct, non-empty column names, the target among them and at least one feature."""
    columns = ", ".join(repr(c) for c in header)
    if any(not name for name in header):
        raise ValueError(f"dataset.source {path}: the header has an empty column name "
                         f"(columns: {columns}); name every column")
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise ValueError(f"dataset.source {path}: column(s) {twice} appear twice in the header; "
                         f"give each column its own name")
    if target is None or str(target) not in header:
        got = "is not set" if target is None else f"'{target}' is not a column"
        raise ValueError(f"dataset.target {got} of {path}; set dataset.target to one of: "
                         f"{columns}")
    if len(header) < 2:
        raise ValueError(f"dataset.source {path} holds only the target column '{target}': "
                         f"it needs at least one feature column")


def parse_numbers(rows: list[tuple[int, list[str]]], header: list[str], path: Path
                  ) -> np.ndarray:
    """The cells of ``rows`` ((file line, cells) pairs) as a float64 array (N, columns); an
    empty cell is NaN. A row of the wrong length or a cell that is not a number is refused,
    naming the first one and the file line."""
    out = np.empty((len(rows), len(header)), dtype=np.float64)
    bad: list[str] = []
    for i, (line, cells) in enumerate(rows):
        if len(cells) != len(header):
            raise ValueError(f"dataset.source {path}, line {line}: {len(cells)} values but the "
                             f"header has {len(header)} columns; every row needs one value per "
                             f"column")
        for j, cell in enumerate(cells):
            text = cell.strip()
            try:
                out[i, j] = float(text) if text else math.nan
            except ValueError:
                out[i, j] = math.nan
                bad.append(f"line {line}, column '{header[j]}': {text!r}")
    if bad:
        raise ValueError(f"dataset.source {path}: {len(bad)} value(s) are not numbers, first at "
                         f"{bad[0]}; every column must be numeric (encode categories as "
                         f"numbers, or drop the column)")
    return out


# --- checks -------------------------------------------------------------------------------------

def check_finite(table: Table) -> None:
    """Every feature and target must be a finite number (NaN, ±inf or an empty cell is not)."""
    for what, values in (("target", table.targets[:, None]), ("feature", table.features)):
        bad = ~np.isfinite(values)
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=1))
            names = (table.target_name,) if what == "target" else table.feature_names
            cols = [names[j] for j in np.flatnonzero(bad.any(axis=0))]
            raise ValueError(
                f"{table.origin}: {int(bad.sum())} {what} value(s) are missing or not finite "
                f"(NaN or ±inf) in {len(rows)} row(s), the first at {table.row_place(rows[0])}, "
                f"column(s) {cols}; remove or fill those rows")


def check_fold_settings(folds: int, fold: int, val_fraction: float) -> None:
    """Settings that need no data: at least 2 folds, a fold index in [0, folds), a fraction
    in (0, 1)."""
    if folds < 2:
        raise ValueError(f"dataset.folds={folds}: k-fold splits need at least 2 folds (one "
                         f"tested, the rest trained on); use e.g. dataset.folds=5")
    if not 0 <= fold < folds:
        raise ValueError(f"dataset.fold={fold} is outside [0, {folds}): the folds are numbered "
                         f"0 … {folds - 1} (dataset.folds={folds}); where the experiment sets "
                         f"dataset.fold=${{seed}} (p2_diabetes), use seeds 0 … {folds - 1}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"dataset.val_fraction={val_fraction} must lie in (0, 1): the share of "
                         f"the training folds held out for validation, e.g. 0.1")


def fold_splits(n: int, folds: int = 5, fold: int = 0, split_seed: int = 0,
                val_fraction: float = 0.1) -> dict[str, np.ndarray]:
    """Row indices (sorted, disjoint, covering range(n)) of train, val and test for one fold:
    test = fold ``fold`` of ``KFold(folds, shuffle=True, random_state=split_seed)``; val =
    ceil(val_fraction · m) of the m other rows, drawn with ``split_seed``; train = the rest."""
    from sklearn.model_selection import KFold, train_test_split

    check_fold_settings(folds, fold, val_fraction)
    if folds > n:
        raise ValueError(f"dataset.folds={folds} is larger than the {n} rows of the data: each "
                         f"fold needs at least one row; use dataset.folds between 2 and {n}")
    rest, test = list(KFold(folds, shuffle=True, random_state=split_seed).split(np.arange(n))
                      )[fold]
    n_val = math.ceil(val_fraction * len(rest))
    if len(rest) - n_val < 2:  # one training row has no spread to standardise by
        raise ValueError(f"dataset.val_fraction={val_fraction} leaves {len(rest) - n_val} of the "
                         f"{len(rest)} training-fold rows for training; at least 2 are needed: "
                         f"lower dataset.val_fraction (or use fewer folds, or more rows)")
    train, val = train_test_split(rest, test_size=n_val, random_state=split_seed)
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


# --- standardisation ----------------------------------------------------------------------------

def feature_scaler(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean (d,), std (d,) and the constant-column mask (d,) of the training features (n, d).

    A column constant on the training rows gets std 1 and its exact value as mean, so its
    training rows are exactly 0 after centring (a computed mean can be off by one rounding)."""
    constant = x_train.max(axis=0) == x_train.min(axis=0)
    mean = np.where(constant, x_train[0], x_train.mean(axis=0))
    std = np.where(constant, 1.0, x_train.std(axis=0))
    return mean, std, constant


def target_scaler(y_train: np.ndarray, origin: str, name: str) -> tuple[float, float]:
    """Mean and std (ddof=0) of the training targets (n,); a constant target is refused."""
    if y_train.max() == y_train.min():
        raise ValueError(f"{origin}: the target '{name}' is constant ({y_train[0]:g}) on all "
                         f"{len(y_train)} training rows: there is nothing to standardise or "
                         f"learn; pick another target column")
    return float(y_train.mean()), float(y_train.std())


# --- the datamodule -----------------------------------------------------------------------------

class TabularRegressionData(DataModule):
    """A regression table cut into k folds; one fold is ``test`` (see the module docstring).

    Inputs (N, d) and targets (N, 1) float32, standardised with the training split's mean and
    std; metrics are in standardised target units (``settings()`` records the target's mean and
    std to convert back).
    """

    name = "tabular"
    task = "regression"
    eval_splits = ("test",)
    ood_splits = ()

    def __init__(self, name: str = "diabetes", source: str = "diabetes",
                 target: str | None = None, folds: int = 5, fold: int = 0,
                 split_seed: int = 0, val_fraction: float = 0.1, batch_size: int = 32,
                 eval_batch_size: int | None = 1000, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        super().__init__(batch_size, eval_batch_size, num_workers, pin_memory)
        self.name, self.source = name, str(source)
        self.folds, self.fold, self.split_seed = int(folds), int(fold), int(split_seed)
        self.val_fraction = float(val_fraction)
        check_fold_settings(self.folds, self.fold, self.val_fraction)  # before reading a file
        table = load_table(self.source, target)
        check_finite(table)
        self.table = table
        self.indices = fold_splits(len(table.targets), self.folds, self.fold, self.split_seed,
                                   self.val_fraction)
        train = self.indices["train"]
        self.x_mean, self.x_std, self.constant = feature_scaler(table.features[train])
        self.y_mean, self.y_std = target_scaler(table.targets[train], table.origin,
                                                table.target_name)
        self._data = {split: self._tensors(idx) for split, idx in self.indices.items()}

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """Build the datamodule from the config (``uqbench.configs.check_types`` calls this
        before the run folder is touched): reading the table and every check on it take
        milliseconds for data this size, and bad data then fails with nothing written."""
        cls(**{k: v for k, v in settings.items() if not k.startswith("_")})

    def _tensors(self, rows: np.ndarray) -> TensorDataset:
        """Standardised rows: inputs (n, d) and targets (n, 1), float32."""
        x = (self.table.features[rows] - self.x_mean) / self.x_std
        y = (self.table.targets[rows] - self.y_mean) / self.y_std
        return TensorDataset(torch.from_numpy(x).float(), torch.from_numpy(y[:, None]).float())

    def setup(self, backbone: InputBackbone | None = None) -> None:
        if backbone is not None:  # the splits are ready; only the backbone's input is checked
            check_modality(self.name, backbone, "tabular")

    def dataset(self, split: str) -> Dataset:
        if split not in self._data:
            raise KeyError(f"split '{split}' is not one of {SPLITS}")
        return self._data[split]

    @property
    def info(self) -> DataInfo:
        return DataInfo(task="regression", in_dim=self.table.features.shape[1], out_dim=1,
                        num_train_batches=self.num_train_batches())

    def settings(self) -> dict[str, Any]:
        """Recorded in results.json; target_mean/target_std convert the metrics back to the
        target's units (y = target_mean + target_std · y_standardised)."""
        return {"source": self.source, "target": self.table.target_name,
                "features": len(self.table.feature_names), "rows": len(self.table.targets),
                "folds": self.folds, "fold": self.fold, "split_seed": self.split_seed,
                "val_fraction": self.val_fraction,
                "sizes": {split: len(idx) for split, idx in self.indices.items()},
                "target_mean": self.y_mean, "target_std": self.y_std,
                "constant_features": [name for name, c in
                                      zip(self.table.feature_names, self.constant, strict=True)
                                      if c]}
