"""CIFAR-100, its CIFAR-10 OOD split and CIFAR-100-C, read from tiny copies in the published
formats through the loaders' real code path."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tests.fixtures.backbones import FakeImageBackbone, colour
from tests.fixtures.datasets import (
    CODE,
    write_cifar10,
    write_cifar100,
    write_cifar100_c,
)
from uqbench.data.cifar import CIFAR100Data, read_cifar
from uqbench.data.on_disk import STANDARD_CORRUPTIONS, DatasetCorruptError, DatasetMissingError

N_TRAIN, N_TEST, N_C = 20, 10, 6


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    labels = write_cifar100(root, N_TRAIN, N_TEST)
    ood = write_cifar10(root, n_test=8)
    c_labels = write_cifar100_c(root, ("fog", "snow"), N_C)
    return root, labels, ood, c_labels


def make(root, **kwargs) -> CIFAR100Data:
    kwargs.setdefault("ood", True)
    data = CIFAR100Data(root, augment=False, batch_size=4, **kwargs)
    data.setup(FakeImageBackbone(size=16, crop_pct=1.0))
    return data


def test_pickles_read_as_torchvision_reads_them(root, monkeypatch):
    """Independent reader: torchvision's own CIFAR100 class (its md5 check switched off, as the
    tiny copy cannot match the published checksums) sees the same images and labels."""
    import torchvision.datasets.cifar as tv_cifar

    root, labels, _, _ = root
    monkeypatch.setattr(tv_cifar.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)
    ours = read_cifar(root / "cifar-100-python", ["train"], "cifar100")
    theirs = tv_cifar.CIFAR100(str(root), train=True, download=False)
    np.testing.assert_array_equal(ours[0], theirs.data)
    assert ours[1].tolist() == theirs.targets == labels["train"].tolist()
    assert theirs.classes[:2] == ["class_0", "class_1"]  # the meta file parses too
    # and the published keys, as the CIFAR page's `encoding="bytes"` recipe shows them
    with open(root / "cifar-100-python" / "train", "rb") as f:
        keys = set(pickle.load(f, encoding="bytes"))
    assert {b"data", b"fine_labels", b"coarse_labels", b"filenames"} <= keys


def test_splits_holdout_and_images(root):
    root, labels, _, _ = root
    data = make(root)
    train, val, test = data.dataset("train"), data.dataset("val"), data.dataset("test")
    assert (len(train), len(val), len(test)) == (18, 2, N_TEST)
    train_idx, val_idx = set(train.indices.tolist()), set(val.indices.tolist())
    assert not train_idx & val_idx and train_idx | val_idx == set(range(N_TRAIN))
    for ds, code, y in ((train, CODE["train"], labels["train"]),
                        (test, CODE["test"], labels["test"])):
        for i in range(len(ds)):
            image, label = ds[i]
            j = int(ds.indices[i])
            assert image.shape == (3, 16, 16)
            assert colour(image) == (code, int(y[j]), j)  # the image of row j, with its label
            assert label == int(y[j])
    assert data.info.num_classes == 100 and data.info.num_train_batches == 5  # ceil(18 / 4)
    assert data.has_val


def test_holdout_is_seeded(root):
    root = root[0]
    val = [tuple(make(root, ood=False, split_seed=s).dataset("val").indices) for s in (0, 0, 1)]
    assert val[0] == val[1] != val[2]
    data = make(root, ood=False, val_fraction=0.0)
    assert not data.has_val and len(data.dataset("train")) == N_TRAIN


def test_ood_is_cifar10_test_through_the_eval_preprocessing(root):
    root, _, ood, _ = root
    data = make(root)
    assert data.ood_splits == ("ood",) and data.eval_splits == ("test",)
    ds = data.dataset("ood")
    assert len(ds) == 8
    assert [colour(ds[i][0])[0] for i in range(8)] == [CODE["cifar10_test"]] * 8
    assert [ds[i][1] for i in range(8)] == ood["test"].tolist()
    assert data.dataset("test").transform is ds.transform  # same preprocessing object


def test_corruption_splits_slice_each_severity(root):
    root, _, _, c_labels = root
    data = make(root, ood=False, corruptions=["fog", "snow"])
    expected = ["test"] + [f"test_c/{c}/{s}" for c in ("fog", "snow") for s in range(1, 6)]
    assert list(data.eval_splits) == expected and data.ood_splits == ()
    for k, name in enumerate(("fog", "snow"), start=1):
        for s in range(1, 6):
            ds = data.dataset(f"test_c/{name}/{s}")
            assert len(ds) == N_C
            for r in (0, N_C - 1):
                image, label = ds[r]
                assert colour(image) == (50 * s, k, r)  # row r of severity block s
                assert label == int(c_labels[(s - 1) * N_C + r])
    # same eval preprocessing as the clean test set
    assert data.dataset("test_c/fog/3").transform is data.dataset("test").transform


def test_corrupted_split_survives_pickling_for_workers(root):
    root = root[0]
    data = make(root, ood=False, corruptions=["snow"], severities=[4])
    ds = data.dataset("test_c/snow/4")
    ds[0]  # maps the file
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._array is None  # the mapping is re-opened in the worker, not copied
    assert colour(clone[2][0]) == (200, 2, 2)  # severity 4, snow (2nd corruption), row 2
    assert list(data.eval_splits) == ["test", "test_c/snow/4"]


def test_loader_batches(root):
    root = root[0]
    data = make(root, ood=False)
    images, labels = next(iter(data.loader("train", train=True)))
    assert images.shape == (4, 3, 16, 16) and images.dtype == torch.float32
    assert labels.shape == (4,) and labels.dtype == torch.int64


def test_preprocessing_from_backbone_and_defaults(root):
    root = root[0]
    data = CIFAR100Data(root, ood=False)
    data.setup(None)  # no backbone: ImageNet mean/std, 224 px
    assert data.dataset("val")[0][0].shape == (3, 224, 224)
    assert data.settings()["preprocessing"]["size"] == [224, 224]
    data.setup(FakeImageBackbone(size=24))
    image, _ = data.dataset("train")[0]  # augment on by default: random resized crop
    assert image.shape == (3, 24, 24)


def test_missing_dataset_names_path_expectation_and_command(tmp_path):
    data = CIFAR100Data(tmp_path / "nowhere")
    with pytest.raises(DatasetMissingError) as err:
        data.setup(None)
    msg = str(err.value)
    assert str(tmp_path / "nowhere" / "cifar-100-python") in msg
    assert "train, test, meta" in msg and "uqbench-data download cifar100" in msg


def test_missing_ood_set_names_cifar10(tmp_path):
    write_cifar100(tmp_path, 5, 5)
    with pytest.raises(DatasetMissingError, match="uqbench-data download cifar10`"):
        CIFAR100Data(tmp_path, ood=True).setup(None)


def test_missing_corruption_file(root):
    root = root[0]
    with pytest.raises(DatasetMissingError) as err:
        CIFAR100Data(root, ood=False, corruptions="standard").setup(None)
    assert "gaussian_noise.npy" in str(err.value)
    assert "uqbench-data download cifar100_c" in str(err.value)


def test_malformed_arrays(tmp_path):
    write_cifar100(tmp_path, 5, 5)
    write_cifar100_c(tmp_path, ("fog",), n=4)
    folder = tmp_path / "CIFAR-100-C"
    np.save(folder / "fog.npy", np.zeros((20, 31, 32, 3), np.uint8))  # wrong image size
    with pytest.raises(DatasetCorruptError, match=r"\(20, 32, 32, 3\) uint8"):
        CIFAR100Data(tmp_path, ood=False, corruptions=["fog"]).setup(None)
    np.save(folder / "fog.npy", np.zeros((25, 32, 32, 3), np.uint8))  # 25 rows, 20 labels
    with pytest.raises(DatasetCorruptError, match="fog.npy has shape"):
        CIFAR100Data(tmp_path, ood=False, corruptions=["fog"]).setup(None)
    np.save(folder / "labels.npy", np.zeros(21, np.uint8))  # not 5 severities × N
    with pytest.raises(DatasetCorruptError, match="5 severities"):
        CIFAR100Data(tmp_path, ood=False, corruptions=["fog"]).setup(None)


def test_malformed_pickle(tmp_path):
    write_cifar100(tmp_path, 5, 5)
    with open(tmp_path / "cifar-100-python" / "test", "wb") as f:
        pickle.dump({"data": np.zeros((5, 100), np.uint8), "fine_labels": [0] * 5}, f)
    with pytest.raises(DatasetCorruptError, match="not a CIFAR batch"):
        CIFAR100Data(tmp_path, ood=False).setup(None)


@pytest.mark.parametrize("kwargs, match", [
    ({"severities": [0, 6]}, "1–5"),
    ({"severities": [1, 1]}, "appear once"),
    ({"corruptions": ["fogg"]}, "unknown corruption.*'fogg'.*gaussian_noise"),
    ({"corruptions": "everything"}, "standard.*all"),
    ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\)"),
    ({"scale": [0.5, 1.5]}, "scale"),
])
def test_bad_settings_fail_at_construction(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CIFAR100Data(tmp_path, **kwargs)


def test_corruption_sets():
    data = CIFAR100Data("unused", corruptions="standard", ood=False)
    assert len(data.eval_splits) == 1 + 15 * 5
    assert {s.split("/")[1] for s in data.eval_splits[1:]} == set(STANDARD_CORRUPTIONS)
    data = CIFAR100Data("unused", corruptions="all", severities=[5], ood=False)
    assert len(data.eval_splits) == 1 + 19
    assert "test_c/saturate/5" in data.eval_splits


@pytest.mark.parametrize("content", [b"garbage" * 10, b""])
def test_a_garbage_or_truncated_pickle_names_the_file(tmp_path, content):
    write_cifar100(tmp_path, 5, 5)
    path = tmp_path / "cifar-100-python" / "test"
    path.write_bytes(content)
    with pytest.raises(DatasetCorruptError, match=f"{path} is corrupt or truncated.*"
                                                  f"uqbench-data download cifar100 --force"):
        CIFAR100Data(tmp_path, ood=False).setup(None)
