"""Flowers-102, DTD and Oxford-IIIT Pets from tiny copies in torchvision's layouts, and the
image preprocessing taken from a backbone's data config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.fixtures.backbones import FakeImageBackbone, colour
from tests.fixtures.datasets import CODE, write_dtd, write_flowers102, write_oxford_pets
from uqbench.data.image_folders import DTDData, Flowers102Data, OxfordPetsData
from uqbench.data.on_disk import DatasetCorruptError, DatasetMissingError
from uqbench.data.transforms import ImagePreprocessing

BACKBONE = FakeImageBackbone(size=16)


def close(a, b, tol=3) -> bool:  # JPEG moves a flat colour by a level or two
    return all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


# --- Flowers-102 ------------------------------------------------------------------------------

def test_flowers_official_splits(tmp_path):
    expected = write_flowers102(tmp_path, (6, 4, 5))
    data = Flowers102Data(tmp_path, augment=False)
    data.setup(BACKBONE)
    assert data.info.num_classes == 102 and data.has_val
    for split in ("train", "val", "test"):
        ds = data.dataset(split)
        assert len(ds) == len(expected[split])
        for j, (image_id, label) in enumerate(expected[split]):
            image, y = ds[j]
            assert image.shape == (3, 16, 16) and y == label
            assert ds.files[j].name == f"image_{image_id:05d}.jpg"
            assert close(colour(image), (CODE[split], 2 * label, j))


def test_flowers_agrees_with_torchvision(tmp_path, monkeypatch):
    """Independent reader: torchvision's Flowers102 (its .mat md5 check switched off)."""
    from torchvision.datasets import Flowers102

    write_flowers102(tmp_path)
    monkeypatch.setattr(Flowers102, "_check_integrity", lambda self: True)
    data = Flowers102Data(tmp_path)
    data.setup(BACKBONE)
    for split in ("train", "val", "test"):
        theirs = Flowers102(str(tmp_path), split=split)
        ours = data.dataset(split)
        assert ours.labels == theirs._labels
        assert [p.name for p in ours.files] == [p.name for p in theirs._image_files]


def test_flowers_missing_image_is_reported(tmp_path):
    expected = write_flowers102(tmp_path)
    image_id = expected["test"][0][0]
    (tmp_path / "flowers-102" / "jpg" / f"image_{image_id:05d}.jpg").unlink()
    with pytest.raises(DatasetMissingError) as err:
        Flowers102Data(tmp_path).setup(BACKBONE)
    assert f"image_{image_id:05d}.jpg" in str(err.value)
    assert "uqbench-data download flowers102" in str(err.value)


def test_flowers_labels_out_of_range(tmp_path):
    from scipy.io import savemat

    write_flowers102(tmp_path, (2, 2, 2))
    savemat(tmp_path / "flowers-102" / "imagelabels.mat", {"labels": np.full((1, 6), 103)})
    with pytest.raises(DatasetCorruptError, match="1..102"):
        Flowers102Data(tmp_path).setup(BACKBONE)


# --- DTD -------------------------------------------------------------------------------------

def test_dtd_partition_splits(tmp_path):
    lines = write_dtd(tmp_path, per_split=2)
    data = DTDData(tmp_path, augment=False)
    data.setup(BACKBONE)
    assert data.info.num_classes == 3
    classes = sorted({rel.split("/")[0] for rel in lines["train"]})
    for split in ("train", "val", "test"):
        ds = data.dataset(split)
        assert len(ds) == 6
        for j, rel in enumerate(lines[split]):
            image, y = ds[j]
            assert y == classes.index(rel.split("/")[0])
            assert colour(image)[1] in range(2 * y - 3, 2 * y + 4)
    files = {s: {rel for rel in lines[s]} for s in lines}
    assert not files["train"] & files["val"] and not files["train"] & files["test"]
    other = DTDData(tmp_path, partition=2)
    other.setup(BACKBONE)
    assert other.dataset("train")._image_files != data.dataset("train")._image_files


def test_dtd_bad_partition_and_missing_split_file(tmp_path):
    with pytest.raises(ValueError, match="1–10"):
        DTDData(tmp_path, partition=11)
    write_dtd(tmp_path)
    (tmp_path / "dtd" / "dtd" / "labels" / "val7.txt").unlink()
    with pytest.raises(DatasetMissingError, match="val7.txt"):
        DTDData(tmp_path).setup(BACKBONE)


# --- Oxford-IIIT Pets --------------------------------------------------------------------------

def test_pets_trainval_holdout_and_test(tmp_path):
    expected = write_oxford_pets(tmp_path, trainval_per_breed=4, test_per_breed=2)
    data = OxfordPetsData(tmp_path, augment=False, val_fraction=0.25, split_seed=0)
    data.setup(BACKBONE)
    train, val, test = data.dataset("train"), data.dataset("val"), data.dataset("test")
    assert (len(train), len(val), len(test)) == (15, 5, 10)
    assert not set(train.indices) & set(val.indices)
    assert set(train.indices) | set(val.indices) == set(range(20))
    assert data.info.num_classes == 37
    for ds, rows in ((val, [expected["trainval"][i] for i in val.indices]),
                     (test, expected["test"])):
        for j, (_, label) in enumerate(rows):
            image, y = ds[j]
            assert y == label
            assert close(colour(image)[:2], (CODE["trainval" if ds is val else "test"], 2 * y))
    again = OxfordPetsData(tmp_path, val_fraction=0.25, split_seed=0)
    again.setup(BACKBONE)
    assert again.dataset("val").indices == val.indices


def test_pets_missing_annotations(tmp_path):
    write_oxford_pets(tmp_path)
    (tmp_path / "oxford-iiit-pet" / "annotations" / "test.txt").unlink()
    with pytest.raises(DatasetMissingError) as err:
        OxfordPetsData(tmp_path).setup(BACKBONE)
    assert "annotations/test.txt" in str(err.value)
    assert "uqbench-data download oxford_pets" in str(err.value)


# --- preprocessing -----------------------------------------------------------------------------

def test_eval_transform_follows_crop_pct():
    """224 px at crop_pct 0.875: resize the short side to floor(224 / 0.875) = 256, centre-crop
    224. A 256×256 image with a 16-px red border and a blue centre must come out all blue."""
    pre = ImagePreprocessing.from_backbone(None)
    assert (pre.size, pre.crop_pct) == ((224, 224), 0.875)
    image = np.zeros((256, 256, 3), np.uint8)
    image[...] = (255, 0, 0)
    image[16:-16, 16:-16] = (0, 0, 255)
    out = pre.eval_transform()(Image.fromarray(image))
    assert out.shape == (3, 224, 224)
    mean, std = torch.tensor(pre.mean)[:, None, None], torch.tensor(pre.std)[:, None, None]
    rgb = out * std + mean
    assert torch.allclose(rgb[2], torch.ones(224, 224), atol=1e-5)
    assert torch.allclose(rgb[0], torch.zeros(224, 224), atol=1e-5)
    # a non-square image keeps its aspect ratio and is centre-cropped to the square size
    assert pre.eval_transform()(Image.new("RGB", (300, 200))).shape == (3, 224, 224)


def test_preprocessing_reads_backbone_config_and_overrides():
    pre = ImagePreprocessing.from_backbone(FakeImageBackbone(size=32, interpolation="bilinear"),
                                           crop_pct=1.0)
    assert (pre.size, pre.crop_pct, pre.interpolation) == ((32, 32), 1.0, "bilinear")
    train = pre.train_transform(augment=True, scale=(0.5, 1.0))(Image.new("RGB", (50, 40)))
    assert train.shape == (3, 32, 32)
    with pytest.raises(ValueError, match="interpolation 'lanczos2'"):
        ImagePreprocessing.from_backbone(FakeImageBackbone(interpolation="lanczos2"))


def test_augment_off_means_eval_transform(tmp_path):
    write_flowers102(tmp_path, (2, 1, 1))
    data = Flowers102Data(tmp_path, augment=False)
    data.setup(BACKBONE)
    a, _ = data.dataset("train")[0]
    b, _ = data.dataset("train")[0]
    assert torch.equal(a, b)  # deterministic: no random crop or flip
