"""Human-rated sentiment sentences from four corpora (Hutto & Gilbert, ICWSM 2014), read from
the source archive of vaderSentiment 3.3.2 under the data root:

    movie_sentences/vaderSentiment-3.3.2.tar.gz
        vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz   (a tar.gz inside)
            hutto_ICWSM_2014/<corpus>_GroundTruth.txt    id <TAB> mean rating <TAB> text

Each rating is the mean of about 20 raters on [−4, 4]. The in-distribution corpus is
``movieReviewSnippets``: Pang & Lee's Rotten Tomatoes sentences, the sentences SST and SST-2 were
built from. The three others (``tweets``, ``amazonReviewSnippets``, ``nytEditorialSnippets``)
carry the same labels on other text: real distribution shift, scored like CIFAR-100-C
(``shift/<corpus>/<metric>`` and their mean ``shift/mean/<metric>``) and, against the movie test
split, as OOD sets (``shift/<corpus>/auroc_mi`` …).

Label: 1 if the mean rating is positive, 0 if negative; a sentence whose |rating| is below
``neutral_band`` is not clearly polar and is left out of every split and corpus (SST-2 keeps
only clearly polar sentences too). Splits of the movie sentences: stratified by label, seeded
by ``split_seed`` (fixed across model seeds), ``test_size`` and ``val_size`` sentences, the
rest the training pool, of which ``train_size`` (stratified, same seed) are used when set.
Each shift corpus is subsampled to ``shift_size`` sentences the same way. The chosen sentence
ids of every split are recorded in the run's settings (``split_ids``) as a hash and counts.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from uqbench.data.on_disk import LAYOUTS, DatasetCorruptError, fetch_hint
from uqbench.data.splits import ListDataset
from uqbench.data.text import SentenceCollator, TextDataModule

SDIST = "vaderSentiment-3.3.2.tar.gz"
INNER = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
CORPORA = {  # short name → the file's corpus name
    "movies": "movieReviewSnippets",
    "tweets": "tweets",
    "amazon": "amazonReviewSnippets",
    "nyt": "nytEditorialSnippets",
}
IN_DISTRIBUTION = "movies"
SHIFTS = ("tweets", "amazon", "nyt")
SHIFT_SPLITS = tuple(f"shift/{c}" for c in SHIFTS)


@dataclass(frozen=True)
class Rated:
    """One rated sentence: its id in the corpus file, the mean rating and the text."""

    id: str
    rating: float
    text: str


def member_name(corpus: str) -> str:
    return f"hutto_ICWSM_2014/{CORPORA[corpus]}_GroundTruth.txt"


def _corrupt(archive: Path, what: str) -> DatasetCorruptError:
    return DatasetCorruptError(
        f"{archive} is not vaderSentiment 3.3.2's source archive: {what}; delete it and "
        f"{fetch_hint('movie_sentences')}")


def read_archive(archive: Path) -> dict[str, bytes]:
    """The four ground-truth files' bytes from the nested archive, by short corpus name."""
    try:
        with tarfile.open(archive, "r:gz") as outer:
            try:
                inner_file = outer.extractfile(INNER)
            except KeyError:
                raise _corrupt(archive, f"it has no member {INNER}") from None
            assert inner_file is not None  # a regular file member
            inner_bytes = inner_file.read()
        with tarfile.open(fileobj=io.BytesIO(inner_bytes), mode="r:gz") as inner:
            out = {}
            for corpus in CORPORA:
                try:
                    member = inner.extractfile(member_name(corpus))
                except KeyError:
                    raise _corrupt(archive, f"{INNER} has no member "
                                            f"{member_name(corpus)}") from None
                assert member is not None
                out[corpus] = member.read()
    except (tarfile.TarError, OSError, EOFError) as err:
        raise _corrupt(archive, f"it cannot be read as a tar.gz ({type(err).__name__}: "
                                f"{err})") from None
    return out


def parse_ground_truth(raw: bytes, where: str) -> list[Rated]:
    """Lines ``id<TAB>rating<TAB>text`` (CRLF line ends; UTF-8, else latin-1) → rows."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        try:
            if len(parts) != 3:
                raise ValueError(f"{len(parts)} tab-separated fields")
            rating = float(parts[1])
            if not -4.0 <= rating <= 4.0:
                raise ValueError(f"rating {rating} outside [-4, 4]")
        except ValueError as err:
            raise DatasetCorruptError(
                f"{where} line {number}: expected 'id<TAB>mean rating in [-4, 4]<TAB>text' "
                f"({err}); {fetch_hint('movie_sentences')}") from None
        rows.append(Rated(parts[0], rating, parts[2].strip()))
    if not rows:
        raise DatasetCorruptError(f"{where} holds no rated sentence; "
                                  f"{fetch_hint('movie_sentences')}")
    return rows


def read_corpora(folder: Path) -> dict[str, list[Rated]]:
    """Every corpus of the archive in ``folder``, parsed."""
    archive = folder / SDIST
    return {c: parse_ground_truth(raw, f"{archive}:{member_name(c)}")
            for c, raw in read_archive(archive).items()}


def check_folder(folder: Path) -> list[str]:
    """The layout check: the archive is there (its content is read when a run sets up)."""
    archive = folder / SDIST
    return [] if archive.is_file() else [f"missing {archive}"]


def polar(rows: list[Rated], neutral_band: float) -> list[tuple[Rated, int]]:
    """(row, label) of the clearly polar rows: label 1 if rating > 0, 0 if < 0; rows with
    |rating| < neutral_band (and every rating of exactly 0) are left out."""
    return [(r, int(r.rating > 0)) for r in rows
            if r.rating != 0 and abs(r.rating) >= neutral_band]


def stratified_take(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``n`` items drawn without replacement, each label's share as in ``labels``
    (largest remainders), sorted; all of them when n >= len(labels)."""
    if n >= len(labels):
        return np.arange(len(labels))
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * n / len(labels)
    take = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - take), kind="stable")[: n - take.sum()]:
        take[i] += 1
    picked = [rng.choice(np.flatnonzero(labels == c), size=k, replace=False)
              for c, k in zip(classes, take, strict=True)]
    return np.sort(np.concatenate(picked))


def ids_digest(rows: list[tuple[Rated, int]]) -> str:
    return hashlib.sha256("\n".join(r.id for r, _ in rows).encode()).hexdigest()[:16]


class MovieSentences(TextDataModule):
    """Binary sentiment of the Rotten Tomatoes sentences; tweets, Amazon reviews and NYT
    editorials as shifted test sets with the same labels (see the module docstring)."""

    num_classes = 2
    layouts = ("movie_sentences",)
    eval_splits = ("test", *SHIFT_SPLITS)
    ood_splits = SHIFT_SPLITS

    def __init__(self, root: str | Path, name: str = "movie_sentences",
                 neutral_band: float = 0.5, test_size: int = 1000, val_size: int = 500,
                 train_size: int | None = None, shift_size: int | None = None,
                 split_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        if not 0 <= float(neutral_band) < 4:
            raise ValueError(f"dataset.neutral_band must be in [0, 4) (|rating| below it is "
                             f"left out), got {neutral_band}")
        for field, value, lowest in (("test_size", test_size, 2), ("val_size", val_size, 2),
                                     ("train_size", train_size, 2),
                                     ("shift_size", shift_size, 2)):
            if value is not None and (not isinstance(value, int) or value < lowest):
                nullable = " or null (all)" if field in ("train_size", "shift_size") else ""
                raise ValueError(f"dataset.{field} must be an integer >= {lowest}{nullable}, "
                                 f"got {value!r}")
        self.neutral_band = float(neutral_band)
        self.test_size, self.val_size = int(test_size), int(val_size)
        self.train_size, self.shift_size = train_size, shift_size
        self.split_seed = int(split_seed)
        self.split_ids: dict[str, Any] = {}

    def build(self) -> dict[str, Dataset]:
        corpora = read_corpora(LAYOUTS["movie_sentences"].path(self.root))
        rng = np.random.default_rng(self.split_seed)
        movies = polar(corpora[IN_DISTRIBUTION], self.neutral_band)
        labels = np.array([y for _, y in movies])
        if len(movies) < self.test_size + self.val_size + 2:
            raise ValueError(f"dataset.test_size + val_size = {self.test_size + self.val_size} "
                             f"leaves no training sentence of the {len(movies)} polar movie "
                             f"sentences")
        test = stratified_take(labels, self.test_size, rng)
        rest = np.setdiff1d(np.arange(len(movies)), test)
        val = rest[stratified_take(labels[rest], self.val_size, rng)]
        pool = np.setdiff1d(rest, val)
        train = pool if self.train_size is None else \
            pool[stratified_take(labels[pool], self.train_size, rng)]
        chosen = {"train": [movies[i] for i in train], "val": [movies[i] for i in val],
                  "test": [movies[i] for i in test]}
        for corpus, split in zip(SHIFTS, SHIFT_SPLITS, strict=True):
            rows = polar(corpora[corpus], self.neutral_band)
            keep = np.arange(len(rows)) if self.shift_size is None else \
                stratified_take(np.array([y for _, y in rows]), self.shift_size, rng)
            chosen[split] = [rows[i] for i in keep]
        self.split_ids = {s: {"n": len(rows), "positive": sum(y for _, y in rows),
                              "ids_sha256": ids_digest(rows)} for s, rows in chosen.items()}
        return {s: ListDataset([(r.text, y) for r, y in rows]) for s, rows in chosen.items()}

    def make_collate(self) -> SentenceCollator:
        return SentenceCollator(self.tokenizer, self.max_length)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "neutral_band": self.neutral_band, "split_seed": self.split_seed,
            "source": f"{SDIST}:{INNER} (Hutto & Gilbert, ICWSM 2014; MIT)",
            "split_ids": self.split_ids}
