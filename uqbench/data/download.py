"""`uqbench-data`: fetch the papers' datasets into the data root and show what is there.

    uqbench-data list [--root DIR] [--verify]
    uqbench-data download NAME... [--root DIR] [--force]      (NAME: see `list`, or `all`)

The data root is ``--root``, else ``$UQBENCH_DATA``, else ``data`` (as ``paths.data_root``).

Every download goes into a hidden temporary folder next to its destination
(``<root>/.partial-<name>-XXXX``), is verified there — the publisher's checksums (torchvision
checks its own md5s; CIFAR-100-C's archive md5 is the one on its Zenodo record), then the
structure and sizes uqbench needs — and only then renamed into place. An interrupted download
leaves at most a ``.partial-*`` folder, which never counts as the dataset (``list`` shows such
leftovers; the next download of that dataset removes them).

Downloading is the one thing in uqbench that uses the network; it turns the Hugging Face
offline switches off for its own process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from uqbench.contracts import sha256_file as sha256
from uqbench.data.on_disk import ALL_CORRUPTIONS, HF_SPLITS, LAYOUTS

CIFAR100_C_URL = "https://zenodo.org/records/3555552/files/CIFAR-100-C.tar?download=1"
CIFAR100_C_TAR = "CIFAR-100-C.tar"
CIFAR100_C_MD5 = "11f0ed0f1191edbf9fa23466ae6021d3"  # Zenodo record 3555552 (2,918,473,216 B)
# Per-file md5s of the extracted arrays, as recorded by torch-uncertainty (for --verify).
CIFAR100_C_FILE_MD5 = {
    "fog": "4efc7ebd5e82b028bdbe13048e3ea564",
    "jpeg_compression": "c851b7f1324e1d2ffddeb76920576d11",
    "zoom_blur": "0204613400c034a81c4830d5df81cb82",
    "speckle_noise": "e3f215b1a0f9fd9fd6f0d1cf94a7ce99",
    "glass_blur": "0bf384f38e5ccbf8dd479d9059b913e1",
    "spatter": "12ccf41d62564d36e1f6a6ada5022728",
    "shot_noise": "b0a1fa6e1e465a747c1b204b1914048a",
    "defocus_blur": "d923e3d9c585a27f0956e2f2ad832564",
    "elastic_transform": "a0792bd6581f6810878be71acedfc65a",
    "gaussian_blur": "5204ba0d557839772ef5a4196a052c3e",
    "frost": "3a39c6823bdfaa0bf8b12fe7004b8117",
    "saturate": "c0697e9fdd646916a61e9c312c77bf6b",
    "brightness": "f22d7195aecd6abb541e27fca230c171",
    "snow": "0237be164583af146b7b144e73b43465",
    "gaussian_noise": "ecc4d366eac432bdf25c024086f5e97d",
    "motion_blur": "732a7e2e54152ff97c742d4c388c5516",
    "contrast": "322bb385f1d05154ee197ca16535f71e",
    "impulse_noise": "3b3c210ddfa0b5cb918ff4537a429fef",
    "labels": "bb4026e9ce52996b95f439544568cdb2",
    "pixelate": "96c00c60f144539e14cffb02ddbd0640",
}
# Hugging Face sources and the published split sizes a download must reproduce.
HF_SOURCES = {
    "sst2": (("nyu-mll/glue", "sst2"), {"train": 67349, "validation": 872, "test": 1821}),
    "arc_easy": (("allenai/ai2_arc", "ARC-Easy"), {"train": 2251, "validation": 570, "test": 2376}),
}
# vaderSentiment 3.3.2's source archive (PyPI's sdist; the wheel lacks the rated sentences)
VADER_SDIST = "vaderSentiment-3.3.2.tar.gz"
VADER_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".zip")
ROOT_HELP = "the data root (default: $UQBENCH_DATA, else ./data)"


def default_root() -> Path:
    return Path(os.environ.get("UQBENCH_DATA") or "data")


# --- fetchers: each writes the dataset's folder into `tmp` (a data root of its own) ---------------

def _fetch_torchvision(name: str) -> Callable[[Path], None]:
    def fetch(tmp: Path) -> None:
        from torchvision import datasets as tv

        # download=True fetches, checks the archive md5 and extracts; constructing the
        # dataset afterwards re-checks torchvision's per-file md5s where it has them.
        if name == "cifar100":
            tv.CIFAR100(str(tmp), train=True, download=True)
            tv.CIFAR100(str(tmp), train=False)
        elif name == "cifar10":
            tv.CIFAR10(str(tmp), train=True, download=True)
            tv.CIFAR10(str(tmp), train=False)
        elif name == "flowers102":
            tv.Flowers102(str(tmp), split="train", download=True)
        elif name == "dtd":
            tv.DTD(str(tmp), split="train", download=True)
        elif name == "oxford_pets":
            tv.OxfordIIITPet(str(tmp), split="trainval", download=True)
    return fetch


def _fetch_cifar100_c(tmp: Path) -> None:
    from torchvision.datasets.utils import download_url, extract_archive

    download_url(CIFAR100_C_URL, str(tmp), filename=CIFAR100_C_TAR, md5=CIFAR100_C_MD5)
    extract_archive(str(tmp / CIFAR100_C_TAR), str(tmp), remove_finished=True)


def _fetch_hf(name: str) -> Callable[[Path], None]:
    def fetch(tmp: Path) -> None:
        from datasets import load_dataset

        (repo, config), sizes = HF_SOURCES[name]
        data = load_dataset(repo, config, cache_dir=str(tmp / ".hf-cache"))
        got = {split: len(data[split]) for split in data}
        if got != sizes:
            raise RuntimeError(f"{repo} {config}: split sizes {got} differ from the published "
                               f"{sizes}; not installing it")
        data.save_to_disk(str(tmp / LAYOUTS[name].folder))
        shutil.rmtree(tmp / ".hf-cache", ignore_errors=True)
    return fetch


def _fetch_vader(tmp: Path) -> None:
    """vaderSentiment 3.3.2's source distribution through pip (the package index is the
    publisher), checked against its sha256."""
    import subprocess

    folder = tmp / LAYOUTS["movie_sentences"].folder
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", "--dest", str(folder), "vaderSentiment==3.3.2"],
                   check=True)
    got = sha256(folder / VADER_SDIST)
    if got != VADER_SHA256:
        raise RuntimeError(f"{VADER_SDIST}: sha256 {got} is not the published {VADER_SHA256}; "
                           f"not installing it")


FETCHERS: dict[str, Callable[[Path], None]] = {
    "cifar100": _fetch_torchvision("cifar100"),
    "cifar10": _fetch_torchvision("cifar10"),
    "cifar100_c": _fetch_cifar100_c,
    "flowers102": _fetch_torchvision("flowers102"),
    "dtd": _fetch_torchvision("dtd"),
    "oxford_pets": _fetch_torchvision("oxford_pets"),
    "sst2": _fetch_hf("sst2"),
    "arc_easy": _fetch_hf("arc_easy"),
    "movie_sentences": _fetch_vader,
}


# --- atomic install ------------------------------------------------------------------------------

def partial_folders(root: Path, name: str | None = None) -> list[Path]:
    pattern = f".partial-{name}-*" if name else ".partial-*"
    return sorted(p for p in root.glob(pattern) if p.is_dir()) if root.is_dir() else []


def install(name: str, root: Path, fetch: Callable[[Path], None] | None = None,
            force: bool = False) -> Path:
    """Fetch ``name`` into a temporary sibling folder, verify it, then rename it into place.

    Returns the installed folder. Nothing under ``root/<folder>`` changes unless the new copy
    passed verification; a failure or interrupt removes the temporary folder.
    """
    layout = LAYOUTS[name]
    dest = layout.path(root)
    if not force and not layout.problems(root):
        print(f"{name}: already complete at {dest} (use --force to fetch again)")
        return dest
    root = dest.parent
    root.mkdir(parents=True, exist_ok=True)
    for old in partial_folders(root, name):  # leftovers of an interrupted download
        shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{name}-", dir=root))
    try:
        (fetch or FETCHERS[name])(tmp)
        staged = tmp / layout.folder
        for archive in (p for p in staged.iterdir() if p.name.endswith(ARCHIVES)
                        and p.name != VADER_SDIST) if staged.is_dir() else ():
            archive.unlink()  # torchvision leaves the archive inside some dataset folders
        problems = layout.problems(tmp)
        if problems:
            raise RuntimeError(f"{name}: the download does not have the expected layout "
                               f"({layout.expected}):\n" + "\n".join(f"  - {p}" for p in problems))
        if dest.exists():  # replace an incomplete (or --force) copy: move it aside first
            os.replace(dest, tmp / "previous")
        os.replace(staged, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: installed at {dest}")
    return dest


# --- verify (checksums) --------------------------------------------------------------------------

def verify(name: str, root: Path) -> str:
    """Checksum verification where checksums exist; a short verdict."""
    from torchvision.datasets.utils import check_integrity

    folder = LAYOUTS[name].path(root)
    if name in ("cifar100", "cifar10"):
        from torchvision import datasets as tv

        cls = tv.CIFAR100 if name == "cifar100" else tv.CIFAR10
        files = cls.train_list + cls.test_list + [[cls.meta["filename"], cls.meta["md5"]]]
        bad = [f for f, md5 in files if not check_integrity(str(folder / f), md5)]
        return f"md5 mismatch: {', '.join(bad)}" if bad else "md5 ok (torchvision)"
    if name == "flowers102":
        from torchvision import datasets as tv

        try:
            tv.Flowers102(str(root), split="train")
        except RuntimeError:
            return "md5 mismatch: imagelabels.mat / setid.mat"
        return "md5 ok (torchvision, .mat files)"
    if name == "cifar100_c":
        bad = [c for c in ALL_CORRUPTIONS + ("labels",)
               if not check_integrity(str(folder / f"{c}.npy"), CIFAR100_C_FILE_MD5[c])]
        return f"md5 mismatch: {', '.join(bad)}" if bad else "md5 ok (20 arrays)"
    if name == "movie_sentences":
        ok = sha256(folder / VADER_SDIST) == VADER_SHA256
        return "sha256 ok" if ok else f"sha256 mismatch: {VADER_SDIST}"
    if name in HF_SOURCES:
        from uqbench.data.on_disk import hf_split_files

        sizes = HF_SOURCES[name][1]
        # the splits are present: verify runs on downloaded data only
        got = {s: _hf_rows(*hf_split_files(folder, s)) for s in HF_SPLITS}  # type: ignore[misc]
        return "sizes ok" if got == sizes else f"sizes {got} differ from published {sizes}"
    return "no per-file checksums published (archive md5 checked at download)"


def _hf_rows(kind: str, files: list[Path]) -> int:
    if kind == "arrow":
        import datasets

        return len(datasets.load_from_disk(str(files[0])))
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


# --- command line --------------------------------------------------------------------------------

def cmd_list(root: Path, check_sums: bool = False) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"datasets under {root.expanduser().absolute()}")
    for column in ("name", "used by dataset=", "folder", "status"):
        table.add_column(column)
    details = []
    for name, layout in LAYOUTS.items():
        problems = layout.problems(root)
        if not layout.path(root).exists():
            status = "[yellow]missing[/]"
        elif problems:
            status = f"[red]incomplete[/] ({len(problems)} problem{'s' * (len(problems) > 1)})"
            details += [f"{name}: {p}" for p in problems[:5]]
        else:
            status = "[green]complete[/]"
            if check_sums:
                status += f", {verify(name, root)}"
        table.add_row(name, ", ".join(layout.used_by), layout.folder + "/", status)
    console.print(table)
    for line in details:
        console.print(line, highlight=False, soft_wrap=True)
    for leftover in partial_folders(root):
        console.print(f"leftover of an interrupted download (safe to delete): {leftover}")
    console.print('fetch with: uqbench-data download NAME... (or make data DATASETS="NAME...")')
    return 0


def cmd_download(names: list[str], root: Path, force: bool) -> int:
    if "all" in names:
        names = list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"error: unknown dataset(s) {unknown}; valid: {', '.join(LAYOUTS)}, all",
              file=sys.stderr)
        return 2
    # The Makefile and CI export HF_*_OFFLINE=1; downloading is the one place to go online.
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "0"
    failed = []
    for name in dict.fromkeys(names):
        try:
            install(name, root, force=force)
        except KeyboardInterrupt:
            print(f"\n{name}: interrupted; nothing was installed", file=sys.stderr)
            return 130
        except Exception as err:  # report and go on with the other datasets
            print(f"error: {name}: {type(err).__name__}: {err}", file=sys.stderr)
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)} (nothing partial was left in place)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="uqbench-data", description="Fetch uqbench's datasets into the data root, or list "
        "what is there. Data root: --root, else $UQBENCH_DATA, else ./data.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="show each dataset, where it is expected, and whether "
                            "it is present and complete")
    p_list.add_argument("--root", type=Path, default=None, help=ROOT_HELP)
    p_list.add_argument("--verify", action="store_true",
                        help="also verify checksums (reads every file: slow on large data)")
    p_dl = sub.add_parser("download", help="download datasets (needs a network)")
    p_dl.add_argument("names", nargs="+", metavar="NAME",
                      help=f"one or more of: {', '.join(LAYOUTS)}, all")
    p_dl.add_argument("--root", type=Path, default=None, help=ROOT_HELP)
    p_dl.add_argument("--force", action="store_true",
                      help="fetch again even if the dataset is complete")
    args = parser.parse_args(argv)
    root = args.root or default_root()
    if args.command == "list":
        return cmd_list(root, args.verify)
    return cmd_download(args.names, root, args.force)


if __name__ == "__main__":
    sys.exit(main())
