"""Where each published dataset lives under the data root, and how to tell it is complete.

One entry per dataset *on disk* (CIFAR-10 is its own entry although only CIFAR-100's OOD
split uses it). The loaders call :func:`require` before reading anything, so a missing or
partial dataset fails at once with the folder looked in, what was expected there and the
command that fetches it; ``uqbench-data list`` runs the same checks.

Checks are structural and fast (files present, every image a split file names exists, array
shapes from the ``.npy`` headers); checksums are verified on download and by
``uqbench-data list --verify``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CIFAR100_FILES = ("train", "test", "meta")
CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                 "data_batch_5", "test_batch", "batches.meta")

# Hendrycks & Dietterich (ICLR 2019): the 15 corruptions of the standard benchmark, then the
# 4 extra ones shipped in the same archive.
STANDARD_CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness",
    "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
ALL_CORRUPTIONS = STANDARD_CORRUPTIONS + EXTRA_CORRUPTIONS
SEVERITIES = (1, 2, 3, 4, 5)
CIFAR_C_ROWS = 50_000  # 5 severities × 10000 test images in the published arrays

DTD_SPLIT_FILES = tuple(f"{s}{p}.txt" for s in ("train", "val", "test") for p in range(1, 11))
HF_SPLITS = ("train", "validation", "test")


class DatasetMissingError(FileNotFoundError):
    """A dataset (or part of it) is not where the data root says it should be."""


class DatasetCorruptError(ValueError):
    """A dataset is present but its content does not have the published shape."""


@dataclass(frozen=True)
class Layout:
    """One published dataset on disk.

    name: the name ``uqbench-data download`` takes.
    folder: the top-level folder under the data root (the unit that is downloaded and moved
        into place atomically).
    expected: what that folder holds, in words, for error messages.
    check: ``check(folder) -> problems``; an empty list means present and complete.
    """

    name: str
    title: str
    folder: str
    expected: str
    check: Callable[[Path], list[str]]
    used_by: tuple[str, ...]

    def path(self, root: str | os.PathLike) -> Path:
        return Path(root).expanduser().absolute() / self.folder

    def problems(self, root: str | os.PathLike) -> list[str]:
        folder = self.path(root)
        if not folder.is_dir():
            return [f"folder {folder} does not exist"]
        return self.check(folder)


# --- checks -------------------------------------------------------------------------------------

def _missing(folder: Path, names: tuple[str, ...] | list[str]) -> list[str]:
    return [f"missing {folder / n}" for n in names if not (folder / n).exists()]


def _check_files(names: tuple[str, ...]) -> Callable[[Path], list[str]]:
    def check(folder: Path) -> list[str]:
        return _missing(folder, names)
    return check


def npy_shape(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from a ``.npy`` header, without reading the data."""
    arr = np.load(path, mmap_mode="r")
    return arr.shape, arr.dtype


def check_cifar_c_file(path: Path, rows: int | None = None) -> str | None:
    """Problem with one CIFAR-100-C array, or None. ``rows`` defaults to the published 50000."""
    try:
        shape, dtype = npy_shape(path)
    except (OSError, ValueError) as err:
        return f"cannot read {path}: {err}"
    want = (CIFAR_C_ROWS if rows is None else rows, 32, 32, 3)
    if shape != want or dtype != np.uint8:
        return (f"{path} has shape {shape} and dtype {dtype}; expected {want} uint8 "
                f"(5 severities × {want[0] // 5} images, 32×32 RGB)")
    return None


def check_cifar_c_labels(path: Path) -> tuple[int | None, str | None]:
    """(rows, problem) for CIFAR-100-C's labels.npy: one label per row, rows divisible by 5."""
    try:
        shape, _ = npy_shape(path)
    except (OSError, ValueError) as err:
        return None, f"cannot read {path}: {err}"
    if len(shape) != 1 or shape[0] == 0 or shape[0] % 5:
        return None, (f"{path} has shape {shape}; expected one label per row, 5 severities "
                      f"× N rows (published: ({CIFAR_C_ROWS},))")
    return shape[0], None


def _check_cifar_c(folder: Path, corruptions: tuple[str, ...] = ALL_CORRUPTIONS) -> list[str]:
    problems = _missing(folder, ["labels.npy"] + [f"{c}.npy" for c in corruptions])
    if problems:
        return problems
    rows, problem = check_cifar_c_labels(folder / "labels.npy")
    if problem:
        return [problem]
    return [p for c in corruptions if (p := check_cifar_c_file(folder / f"{c}.npy", rows))]


def _listed_images_missing(images: Path, relpaths: list[str], limit: int = 3) -> list[str]:
    """Problems for images a split file names but the images folder lacks (one listdir each)."""
    present: dict[Path, set[str]] = {}
    missing = []
    for rel in relpaths:
        path = images / rel
        names = present.get(path.parent)
        if names is None:
            names = present[path.parent] = (set(os.listdir(path.parent))
                                            if path.parent.is_dir() else set())
        if path.name not in names:
            missing.append(str(path))
    if not missing:
        return []
    more = f" (and {len(missing) - limit} more)" if len(missing) > limit else ""
    return [f"{len(missing)} images named by the split files are missing: "
            f"{', '.join(missing[:limit])}{more}"]


def flowers_image_ids(folder: Path) -> dict[str, list[int]]:
    """Image ids of each official split from ``setid.mat`` (torchvision's reading)."""
    from scipy.io import loadmat

    setid = loadmat(folder / "setid.mat", squeeze_me=True)
    return {split: np.atleast_1d(setid[key]).astype(int).tolist()
            for split, key in (("train", "trnid"), ("val", "valid"), ("test", "tstid"))}


def _check_flowers(folder: Path) -> list[str]:
    problems = _missing(folder, ["jpg", "imagelabels.mat", "setid.mat"])
    if problems:
        return problems
    try:
        ids = flowers_image_ids(folder)
    except (KeyError, ValueError, OSError) as err:
        return [f"cannot read {folder / 'setid.mat'} (keys trnid, valid, tstid): {err!r}"]
    names = [f"image_{i:05d}.jpg" for split in ids.values() for i in split]
    return _listed_images_missing(folder / "jpg", names)


def _check_dtd(folder: Path) -> list[str]:
    data = folder / "dtd"
    problems = _missing(data, ["images", "labels"])
    if problems:
        return problems
    problems = _missing(data / "labels", DTD_SPLIT_FILES)
    if problems:
        return problems
    listed = {rel for f in DTD_SPLIT_FILES for rel in (data / "labels" / f).read_text().split()}
    return _listed_images_missing(data / "images", sorted(listed))


def read_pets_split(annotations: Path, split: str) -> list[tuple[str, int]]:
    """(image id, 0-based class) of each line ``<image_id> <class 1..37> <species> <breed>``."""
    rows = []
    for line in (annotations / f"{split}.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            image_id, label, *_ = line.split()
            rows.append((image_id, int(label) - 1))
    return rows


def _check_pets(folder: Path) -> list[str]:
    problems = _missing(folder, ["images", "annotations/trainval.txt", "annotations/test.txt"])
    if problems:
        return problems
    try:
        names = [f"{image_id}.jpg" for split in ("trainval", "test")
                 for image_id, _ in read_pets_split(folder / "annotations", split)]
    except ValueError as err:
        return [f"cannot parse {folder / 'annotations'}/*.txt "
                f"(lines '<image_id> <class> <species> <breed>'): {err}"]
    return _listed_images_missing(folder / "images", names)


def hf_split_files(folder: Path, split: str) -> tuple[str, list[Path]] | None:
    """How a Hugging Face split is stored: ("arrow", [dir]) from ``save_to_disk`` or
    ("parquet", files) for ``<split>-*.parquet`` / ``<split>/*.parquet``; None if absent."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        part = folder / split
        if split in splits and (part / "state.json").is_file() and any(part.glob("*.arrow")):
            return "arrow", [part]
        return None
    files = sorted(folder.glob(f"{split}-*.parquet")) + sorted((folder / split).glob("*.parquet"))
    return ("parquet", files) if files else None


def _check_hf(folder: Path) -> list[str]:
    return [f"split '{s}' not found in {folder} (neither a save_to_disk folder with "
            f"dataset_dict.json nor {s}-*.parquet)" for s in HF_SPLITS
            if hf_split_files(folder, s) is None]


# --- the catalogue --------------------------------------------------------------------------

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout("cifar100", "CIFAR-100", "cifar-100-python",
           "torchvision's CIFAR-100 layout: the python pickles train, test, meta",
           _check_files(CIFAR100_FILES), ("cifar100", "cifar100_c")),
    Layout("cifar10", "CIFAR-10 (OOD set of CIFAR-100)", "cifar-10-batches-py",
           "torchvision's CIFAR-10 layout: data_batch_1..5, test_batch, batches.meta",
           _check_files(CIFAR10_FILES), ("cifar100",)),
    Layout("cifar100_c", "CIFAR-100-C", "CIFAR-100-C",
           "labels.npy and 19 <corruption>.npy arrays, each 50000×32×32×3 uint8 "
           "(5 severities × 10000, severity 1 first)",
           _check_cifar_c, ("cifar100_c",)),
    Layout("flowers102", "Oxford Flowers-102", "flowers-102",
           "torchvision's Flowers102 layout: jpg/image_NNNNN.jpg, imagelabels.mat, setid.mat",
           _check_flowers, ("flowers102",)),
    Layout("dtd", "Describable Textures (DTD)", "dtd",
           "torchvision's DTD layout: dtd/images/<class>/*.jpg and "
           "dtd/labels/{train,val,test}{1..10}.txt",
           _check_dtd, ("dtd",)),
    Layout("oxford_pets", "Oxford-IIIT Pets", "oxford-iiit-pet",
           "torchvision's OxfordIIITPet layout: images/*.jpg, annotations/trainval.txt "
           "and annotations/test.txt",
           _check_pets, ("oxford_pets",)),
    Layout("sst2", "SST-2 (GLUE)", "sst2",
           "GLUE sst2 saved with datasets' save_to_disk (or <split>-*.parquet files): splits "
           "train, validation, test; columns sentence, label, idx",
           _check_hf, ("sst2",)),
    Layout("arc_easy", "ARC-Easy (allenai/ai2_arc)", "arc_easy",
           "allenai/ai2_arc ARC-Easy saved with datasets' save_to_disk (or <split>-*.parquet "
           "files): splits train, validation, test; columns id, question, choices, answerKey",
           _check_hf, ("arc_easy",)),
    Layout("movie_sentences", "Rated sentiment sentences (vaderSentiment 3.3.2 source)",
           "movie_sentences",
           "vaderSentiment 3.3.2's source archive vaderSentiment-3.3.2.tar.gz (pip download "
           "--no-deps --no-binary :all: vaderSentiment==3.3.2), holding "
           "additional_resources/hutto_ICWSM_2014.tar.gz",
           _check_files(("vaderSentiment-3.3.2.tar.gz",)), ("movie_sentences",)),
)}


def fetch_hint(name: str) -> str:
    return (f"fetch it with `uqbench-data download {name}` (or `make data DATASETS={name}`) on "
            f"a machine with a network, or point paths.data_root (env UQBENCH_DATA) at the "
            f"folder that holds it")


def missing_error(name: str, root: str | os.PathLike, problems: list[str], hint: str = ""
                  ) -> DatasetMissingError:
    layout = LAYOUTS[name]
    shown = "\n".join(f"  - {p}" for p in problems[:5])
    if len(problems) > 5:
        shown += f"\n  - … and {len(problems) - 5} more"
    return DatasetMissingError(
        f"{layout.title} is missing or incomplete under the data root {Path(root).absolute()}\n"
        f"  looked in: {layout.path(root)}\n"
        f"  expected:  {layout.expected}\n"
        f"{shown}\n"
        f"  fix: {fetch_hint(name)}{hint}")


def require(name: str, root: str | os.PathLike) -> Path:
    """The dataset's folder under ``root``; raises :class:`DatasetMissingError` if incomplete."""
    layout = LAYOUTS[name]
    problems = layout.problems(root)
    if problems:
        raise missing_error(name, root, problems)
    return layout.path(root)
