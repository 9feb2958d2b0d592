"""Pretrain the digits ViTs (`uqbench-pretrain`) and measure each level's linear probe.

    uqbench-pretrain                            # every level, pretraining seeds 0 … 4
    uqbench-pretrain other --seeds 0 --force    # rebuild one level and seed
    uqbench-pretrain --jobs 2 --cache-dir DIR   # two at a time; default dir: $UQBENCH_CACHE
                                                # or .cache/uqbench (the runner's cache_dir)
    uqbench-pretrain --design                   # choose the design on validation

A pretrained level (:data:`~uqbench.backbones.digits_vit.RECIPES`) is trained supervised on the
pretraining images (the other digits, 0–2 by default, :func:`~uqbench.data.digits.digits_splits`;
never the downstream or OOD images), plus, for the levels that have seen the downstream kind,
images of the kind pool (other images of 5–9, never a downstream split) with their k-means
clusters as targets (or, in the first protocol, their labels), with a linear head that is then
dropped: the checkpoint holds the encoder only, as the DINO checkpoints do. It is written with
its sidecar JSON, then loaded back through :class:`~uqbench.backbones.timm_vit.TimmViT` (timm's
pretrained loader) for the probe. A cached, intact checkpoint is reused without training; a
corrupt one is refused.

Backbone quality is the standard linear probe: logistic regression (scikit-learn, standardised
features) on the frozen features of the downstream train split, accuracy on its **validation**
split (the levels are designed and spaced on it; no probe reads the test split). The random
level's probe uses timm's initialisation under its seed (no weights are stored).

Determinism: one thread, ``torch.use_deterministic_algorithms`` and seeded data order make a
rebuild on the same machine bit-identical (same sha256). Across CPUs it is not: float kernels
differ by instruction set, so another machine's weights differ in the last bits and training
amplifies that; the benchmark therefore pretrains every level with several seeds and reports
the spread over them.

Longer than most modules: what a level trains on (the images and their targets, labels or
clusters), the training, the probe, the cache and its command line are one command's parts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchvision import transforms as T

from uqbench.backbones.digits_vit import (
    ARCHITECTURE,
    DEFAULT_SPLIT,
    DESIGN_FILE,
    LEVELS,
    MODEL,
    build_command,
    checkpoint_paths,
    normal_split,
    pretrain_settings,
    read_sidecar,
    verify_checkpoint,
    write_weights,
)
from uqbench.backbones.timm_vit import TimmViT
from uqbench.contracts import sha256_file
from uqbench.data.digits import (
    DOWNSTREAM_CLASSES,
    DigitsData,
    balanced_head,
    digit_images,
    digits_splits,
    pretrain_classes,
)
from uqbench.data.image_base import ArrayImageDataset
from uqbench.data.transforms import ImagePreprocessing
from uqbench.errors import user_errors


@dataclass
class Pretrained:
    """A level and seed in the cache: weights (None: random), sidecar, its content, built now?"""

    level: str
    seed: int
    weights: Path | None
    sidecar: Path
    meta: dict[str, Any]
    built: bool


def _encoder_spec() -> TimmViT:
    """The architecture with random weights (data_config and building)."""
    return TimmViT("digits_vit", MODEL, pretrained=False, model_kwargs=ARCHITECTURE)


@torch.no_grad()
def features(encoder: nn.Module, x: torch.Tensor, batch: int = 256) -> np.ndarray:
    """Frozen features: images (N, 3, H, W) → (N, embed_dim)."""
    encoder.eval()
    return torch.cat([encoder(x[i:i + batch]) for i in range(0, len(x), batch)]).numpy()


def _split_tensors(data: DigitsData, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's images (N, 3, H, W) and labels (N,)."""
    dataset = data.dataset(split)
    assert isinstance(dataset, TensorDataset)  # DigitsData holds every split in memory
    return dataset.tensors[0], dataset.tensors[1]


def linear_probe(encoder: nn.Module, split: dict[str, Any], max_images: int | None = None
                 ) -> dict[str, Any]:
    """Accuracy of a logistic regression on frozen features: fitted on the downstream train
    split, scored on its validation split."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    data = DigitsData(split_seed=int(split["split_seed"]),
                      kind_fraction=float(split["kind_fraction"]),
                      ood_classes=split.get("ood_classes"), ood=False, corruptions=None,
                      max_per_split=max_images)
    data.setup(_encoder_spec())
    (x_tr, y_tr), (x_val, y_val) = (_split_tensors(data, s) for s in ("train", "val"))
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    probe.fit(features(encoder, x_tr), y_tr.numpy())
    acc = float((probe.predict(features(encoder, x_val)) == y_val.numpy()).mean())
    return {"acc": acc, "split": "val", "n_train": len(y_tr), "n_eval": len(y_val),
            "classifier": "StandardScaler + LogisticRegression(max_iter=5000)"}


def _train_transform(preprocessing: ImagePreprocessing, augment: bool) -> Callable:
    eval_tf = preprocessing.eval_transform()
    if not augment:
        return eval_tf
    # small affine jitter keeps a digit the same digit (no flips, no crops that cut strokes)
    return T.Compose([T.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1),
                                     interpolation=T.InterpolationMode.BILINEAR, fill=0),
                      eval_tf])


def pretraining_images(recipe: dict[str, Any], split: dict[str, Any],
                       max_images: int | None = None, seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray, int]:
    """What a recipe trains on: indices into :func:`digit_images`, the target of each (aligned
    with the indices) and the number of targets. The pretraining images of the other digits keep
    their digit (as 0 … n−1) and ``kind_images`` of the kind pool (5–9; null: all) join them,
    targeted by their pixel clusters (``kind_targets: clusters``: k-means, never the labels) or
    by their digit (no ``kind_targets``: the first protocol's); ``seed``: the pretraining seed,
    which seeds the clustering."""
    _, labels = digit_images(ARCHITECTURE["img_size"])
    splits = digits_splits(labels, int(split["split_seed"]),
                           kind_fraction=float(split["kind_fraction"]),
                           ood_classes=split.get("ood_classes"))
    classes = pretrain_classes(split.get("ood_classes"))
    idx = balanced_head(splits["pretrain"], labels, max_images)
    targets = np.searchsorted(np.asarray(classes), labels[idx])
    kind = recipe.get("kind_images", 0)
    if kind == 0:
        return idx, targets, len(classes)
    extra = balanced_head(splits["kind"], labels, None if kind is None else int(kind))
    if max_images is not None:
        extra = balanced_head(extra, labels, max_images)
    if recipe.get("kind_targets", "labels") == "labels":
        extra_targets = len(classes) + labels[extra] - DOWNSTREAM_CLASSES[0]
        n = len(classes) + len(DOWNSTREAM_CLASSES)
    else:
        clusters = int(recipe["kind_clusters"])
        extra_targets = len(classes) + kind_clusters(extra, clusters, int(seed))
        n = len(classes) + clusters
    order = np.argsort(np.concatenate([idx, extra]), kind="stable")
    return (np.concatenate([idx, extra])[order], np.concatenate([targets, extra_targets])[order],
            n)


def kind_clusters(indices: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Cluster ids (0 … k−1) of the digits ``indices`` by k-means on their 8×8 pixels: the kind
    pool's targets without its labels. ``seed``: k-means' initialisation (the pretraining
    seed's, so the clustering is part of a level's randomness)."""
    from sklearn.cluster import KMeans
    from sklearn.datasets import load_digits

    pixels = load_digits().data[indices]
    k = min(int(k), len(indices))
    return KMeans(n_clusters=k, n_init=10, random_state=int(seed)).fit_predict(pixels)


def train_supervised(recipe: dict[str, Any], split: dict[str, Any], seed: int,
                     max_images: int | None = None, log: Callable[[str], None] = print
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train the ViT with a linear head on a recipe's pretraining images; return the encoder's
    state dict (head removed) and facts about the training."""
    import timm

    torch.manual_seed(int(seed))
    images, labels = digit_images(ARCHITECTURE["img_size"])
    idx, targets, classes = pretraining_images(recipe, split, max_images, int(seed))
    full = np.full(len(labels), -1, dtype=np.int64)
    full[idx] = targets  # the target of each pretraining image, by its index into the digits
    preprocessing = ImagePreprocessing.from_backbone(_encoder_spec(), crop_pct=1.0)
    dataset = ArrayImageDataset(images, full, _train_transform(preprocessing,
                                                               bool(recipe["augment"])), idx)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=int(recipe["batch_size"]), shuffle=True,
        generator=torch.Generator().manual_seed(int(seed)))
    model = timm.create_model(MODEL, pretrained=False, num_classes=classes, **ARCHITECTURE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(recipe["lr"]),
                                  weight_decay=float(recipe["weight_decay"]))
    total = int(recipe["epochs"]) * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    start, correct, seen = time.perf_counter(), 0, 0
    model.train()
    for epoch in range(1, int(recipe["epochs"]) + 1):
        correct, seen, running = 0, 0, 0.0
        for x, y in loader:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item() * len(y)
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
        if epoch == 1 or epoch % 10 == 0 or epoch == int(recipe["epochs"]):
            log(f"  epoch {epoch}/{recipe['epochs']}: loss {running / seen:.3f}, "
                f"train acc {correct / seen:.3f}")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not k.startswith("head.")}
    return state, {"seconds": round(time.perf_counter() - start, 2), "images": len(idx),
                   "classes": classes, "final_epoch_train_acc": round(correct / max(seen, 1), 4)}


def _write_json(path: Path, content: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=2) + "\n")
    tmp.replace(path)  # atomic: a sidecar is either absent or complete


@contextmanager
def deterministic(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: as is) and deterministic algorithms."""
    before, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if threads:
        torch.set_num_threads(int(threads))
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        torch.use_deterministic_algorithms(strict)


def pretrain(level: str, cache_dir: str | Path, split: dict[str, Any] | None = None,
             seed: int = 0, force: bool = False, recipe: dict[str, Any] | None = None,
             max_images: int | None = None, threads: int | None = 1,
             log: Callable[[str], None] = print, kind_targets: str = "clusters") -> Pretrained:
    """Build ``level`` with pretraining ``seed`` in ``cache_dir`` (or reuse it when cached and
    intact).

    split: the digits split ({split_seed, kind_fraction, ood_classes}; default: the dataset's
    defaults). kind_targets: how the kind pool is learnt (clusters | labels).
    recipe: replaces the level's recipe; max_images: pretraining and probe images per split
    (both for quick checks; both change the fingerprint, so they never shadow a real level).
    threads: torch threads while training; 1 by default: for this tiny model a second thread
    only adds synchronisation (a step is ~20× slower with 2 busy cores)."""
    with deterministic(threads):
        return _pretrain(level, cache_dir, normal_split(split), int(seed), force, recipe,
                         max_images, log, kind_targets)


def _pretrain(level: str, cache_dir: str | Path, split: dict[str, Any], seed: int, force: bool,
              recipe: dict[str, Any] | None, max_images: int | None,
              log: Callable[[str], None], kind_targets: str) -> Pretrained:
    settings = pretrain_settings(level, split, seed, recipe, kind_targets)
    if max_images is not None:
        settings["max_images"] = int(max_images)
    weights, sidecar = checkpoint_paths(cache_dir, settings)
    rebuild = build_command(level, cache_dir, split, seed, kind_targets)
    if settings["recipe"] is None:  # random: nothing to train; the sidecar holds the probe
        if not force and (meta := read_sidecar(sidecar)) is not None:
            return Pretrained(level, seed, None, sidecar, meta, built=False)
        torch.manual_seed(seed)
        start = time.perf_counter()
        probe = linear_probe(_encoder_spec().build(), split, max_images)
        meta = {"level": level, "seed": seed, "settings": settings, "probe": probe,
                "probe_s": round(time.perf_counter() - start, 2)}
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        _write_json(sidecar, meta)
        return Pretrained(level, seed, None, sidecar, meta, built=True)
    if not force and weights.is_file():
        return Pretrained(level, seed, weights, sidecar,
                          verify_checkpoint(weights, sidecar, rebuild), built=False)
    log(f"pretraining digits ViT '{level}' (seed {seed}) → {weights}")
    state, facts = train_supervised(settings["recipe"], split, seed, max_images, log)
    weights.parent.mkdir(parents=True, exist_ok=True)
    sidecar.unlink(missing_ok=True)  # weights without a sidecar are refused until it is written
    tmp = weights.with_name(weights.name + ".tmp")
    write_weights(state, tmp, settings)
    tmp.replace(weights)
    loaded = TimmViT(f"digits_vit_{level}", MODEL, pretrained=True, checkpoint=str(weights),
                     model_kwargs=ARCHITECTURE).build()  # the path the runner takes
    start = time.perf_counter()
    probe = linear_probe(loaded, split, max_images)
    meta = {"level": level, "seed": seed, "settings": settings, "weights": weights.name,
            "bytes": weights.stat().st_size, "sha256": sha256_file(weights),
            "pretrain": facts, "probe": probe,
            "probe_s": round(time.perf_counter() - start, 2)}
    _write_json(sidecar, meta)
    return Pretrained(level, seed, weights, sidecar, meta, built=True)


def _build_one(job: tuple[str, int, str, dict[str, Any], bool, int | None, str]
               ) -> Pretrained:
    """One (level, seed) for :func:`main`, in this process or a worker."""
    level, seed, cache_dir, split, force, threads, kind_targets = job
    # a corrupt cached checkpoint: uqbench's one error line, no traceback (nothing is
    # logged: without a handler the log line would print to stderr a second time)
    with user_errors(catch=(ValueError,), logged=False):
        return pretrain(level, cache_dir, split, seed, force=force, threads=threads,
                        kind_targets=kind_targets,
                        log=lambda line: print(f"[{level} s{seed}] {line.strip()}", flush=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="uqbench-pretrain",
        description="Pretrain the digits ViTs (backbone=digits_vit_<level>) into the cache, "
                    "or reuse them, and print each level's linear-probe accuracy.")
    parser.add_argument("levels", nargs="*", default=list(LEVELS),
                        help=f"levels to build (default: all): {', '.join(LEVELS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                        help="pretraining seeds (default: 0 … 4, the benchmark's run seeds)")
    parser.add_argument("--cache-dir", default=os.environ.get("UQBENCH_CACHE", ".cache/uqbench"),
                        help="the runner's paths.cache_dir (default: $UQBENCH_CACHE or "
                             ".cache/uqbench)")
    parser.add_argument("--split-seed", type=int, default=DEFAULT_SPLIT["split_seed"],
                        help="digits split seed (the runner's dataset.split_seed)")
    parser.add_argument("--kind-fraction", type=float, default=DEFAULT_SPLIT["kind_fraction"],
                        help="share of the images 5–9 in the kind pool (dataset.kind_fraction)")
    parser.add_argument("--ood-classes", nargs="+", default=DEFAULT_SPLIT["ood_classes"],
                        metavar="DIGIT",
                        help="the OOD digits, which no level pretrains on (dataset.ood_classes; "
                             "default: 3 4); 'none': a held-out third of 0–4 (first protocol)")
    parser.add_argument("--kind-targets", choices=["clusters", "labels"], default="clusters",
                        help="how the near and foundation levels learn the kind pool: its "
                             "k-means clusters (default) or its labels (first protocol)")
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per pretraining (default 1: fastest for this model)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="pretrainings at a time, each in its own process (default 1)")
    parser.add_argument("--design", action="store_true",
                        help="choose the design (pooling, augmentation) on the validation "
                             f"probe of the 'other' level and rewrite {DESIGN_FILE.name}")
    args = parser.parse_args(argv)
    bad = [lv for lv in args.levels if lv not in LEVELS]
    if bad:
        parser.error(f"unknown level(s) {bad}; valid: {', '.join(LEVELS)}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.design:
        from uqbench.runner.jobs.pretrain_design import choose_design, write_design

        recipe = choose_design(pretrain, args.cache_dir, seeds=tuple(args.seeds), jobs=args.jobs,
                               threads=args.threads)
        write_design(recipe)
        for cand in recipe["provenance"]["candidates"]:
            print(f"  {cand}")
        print(f"chosen: {recipe['choices']} → {DESIGN_FILE}")
        return
    ood = None if [str(c).lower() for c in args.ood_classes] == ["none"] else args.ood_classes
    try:
        split = normal_split({"split_seed": args.split_seed, "kind_fraction": args.kind_fraction,
                              "ood_classes": ood})
    except ValueError as error:
        parser.error(str(error).replace("dataset.ood_classes", "--ood-classes"))
    jobs = [(level, seed, args.cache_dir, split, args.force, args.threads, args.kind_targets)
            for level in dict.fromkeys(args.levels) for seed in dict.fromkeys(args.seeds)]
    if args.jobs == 1:
        results = [_build_one(job) for job in jobs]
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(_build_one, jobs, chunksize=1)
    rows = [(r.level, str(r.seed), "built" if r.built else "cached",
             f"{r.meta['probe']['acc']:.3f}",
             f"{r.meta.get('pretrain', {}).get('seconds', 0.0):.1f}",
             str(r.weights or r.sidecar)) for r in results]
    header = ("level", "seed", "status", "val probe", "pretrain s", "file")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
