"""The digits benchmark: splits, corruptions, the pretrained digits ViTs and their cache, and a
run through the real runner. Expected sizes are hand computations on scikit-learn's own counts."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sklearn.datasets import load_digits

from tests.fixtures.backbones import MEAN, STD, FakeImageBackbone
from uqbench.backbones.digits_vit import (
    ARCHITECTURE,
    MODEL,
    CheckpointCorruptError,
    DigitsViT,
    checkpoint_paths,
)
from uqbench.backbones.timm_vit import TimmViT
from uqbench.data import digits as digits_module
from uqbench.data.digits import DigitsData, corrupt_images, digit_images, digits_splits
from uqbench.runner.cli import run

TINY = {"kind_images": 0, "epochs": 1, "lr": 1e-3, "weight_decay": 0.0, "batch_size": 5,
        "augment": True}
COUNTS = np.bincount(load_digits().target)  # images per class, from scikit-learn itself


def make(**kwargs) -> DigitsData:
    kwargs.setdefault("corruptions", None)
    data = DigitsData(**kwargs)
    data.setup(FakeImageBackbone(size=32, crop_pct=1.0))
    return data


# --- splits ------------------------------------------------------------------------------------

def test_default_ood_is_every_image_of_classes_no_level_pretrains_on():
    _, labels = digit_images(32)
    splits = digits_splits(labels, split_seed=0)
    sizes = {k: len(v) for k, v in splits.items()}
    # every image of 0–2 pretrains, every image of 3 and 4 is OOD (counts: scikit-learn's)
    assert sizes["pretrain"] == COUNTS[:3].sum() == 537 and sizes["ood"] == COUNTS[3:5].sum()
    assert set(labels[splits["pretrain"]]) == {0, 1, 2} and set(labels[splits["ood"]]) == {3, 4}
    assert (sizes["kind"], sizes["train"], sizes["val"], sizes["test"]) == (224, 269, 134, 269)
    every = np.concatenate(list(splits.values()))
    assert len(np.unique(every)) == len(every) == len(labels)
    # the downstream splits are the first protocol's: ood_classes only moves 0–4
    first = digits_splits(labels, split_seed=0, ood_classes=None)
    assert all(np.array_equal(splits[k], first[k]) for k in ("kind", "train", "val", "test"))
    for bad in ([], [0, 1, 2, 3, 4], [7], "three"):
        with pytest.raises(ValueError, match="dataset.ood_classes"):
            digits_splits(labels, ood_classes=bad)


def test_no_level_pretrains_on_an_ood_image_or_class(monkeypatch, tmp_path):
    from uqbench.backbones.digits_vit import level_recipe
    from uqbench.runner.jobs import pretrain as module

    _, labels = digit_images(32)
    split = {"split_seed": 0, "kind_fraction": 0.25, "ood_classes": [3, 4]}
    splits = digits_splits(labels)
    for level in ("other", "near", "foundation"):
        idx, _, _ = module.pretraining_images(level_recipe(level), split, seed=0)
        assert not set(labels[idx]) & {3, 4}, level  # no image of an OOD class, any level
        assert not set(idx) & set(np.concatenate([splits[k] for k in ("ood", "train", "val",
                                                                      "test")]))


def test_splits_are_disjoint_stratified_and_of_the_documented_sizes():
    _, labels = digit_images(32)
    splits = digits_splits(labels, split_seed=0, ood_classes=None)  # the first protocol
    n_up, n_down = COUNTS[:5].sum(), COUNTS[5:].sum()  # 901, 896
    # sklearn rounds a fractional test part up (ceil(901/3)); the 5–9 parts are whole counts
    n_ood = math.ceil(n_up / 3)
    n_kind, n_test, n_val = round(0.25 * n_down), round(0.30 * n_down), round(0.15 * n_down)
    sizes = {k: len(v) for k, v in splits.items()}
    assert sizes == {"pretrain": n_up - n_ood, "ood": n_ood, "kind": n_kind,
                     "train": n_down - n_kind - n_test - n_val, "val": n_val,
                     "test": n_test} == {"pretrain": 600, "ood": 301, "kind": 224,
                                         "train": 269, "val": 134, "test": 269}
    every = np.concatenate(list(splits.values()))
    assert len(np.unique(every)) == len(every) == len(labels)  # disjoint, covering all 1797
    for name, fraction, classes in (("ood", 1 / 3, range(5)), ("kind", 0.25, range(5, 10)),
                                    ("test", 0.30, range(5, 10)), ("val", 0.15, range(5, 10))):
        per_class = np.bincount(labels[splits[name]], minlength=10)
        for c in classes:  # stratified: each class's share within one image of the fraction
            assert abs(per_class[c] - fraction * COUNTS[c]) <= 1, (name, c)
    assert set(labels[splits["pretrain"]]) == set(labels[splits["ood"]]) == {0, 1, 2, 3, 4}
    assert (set(labels[splits["train"]]) == set(labels[splits["test"]])
            == set(labels[splits["kind"]]) == {5, 6, 7, 8, 9})
    # fixed across calls (model seeds never enter), different for another split seed
    assert all(np.array_equal(v, digits_splits(labels, 0, ood_classes=None)[k])
               for k, v in splits.items())
    assert not np.array_equal(splits["ood"], digits_splits(labels, 1, ood_classes=None)["ood"])


def test_images_labels_and_preprocessing():
    data = make()
    raw = load_digits()
    images, labels = digit_images(32)
    assert images.shape == (1797, 32, 32, 3) and images.dtype == np.uint8
    assert np.array_equal(labels, raw.target)
    # 0–16 → 0–255, upsampled bilinearly: torch's bilinear interpolation agrees to rounding
    source = torch.tensor(np.round(raw.images * 255 / 16), dtype=torch.float32)[:, None]
    reference = torch.nn.functional.interpolate(source, size=32, mode="bilinear",
                                                align_corners=False)[:, 0].numpy()
    assert np.abs(reference - images[..., 0]).max() <= 1
    assert (images == images[..., :1]).all()  # grey in all three channels
    x, y = data.dataset("test").tensors
    idx = data.split_indices()["test"]
    assert y.tolist() == (raw.target[idx] - 5).tolist()  # digits 5–9 → classes 0–4
    expected = (images[idx].transpose(0, 3, 1, 2) / 255 - MEAN[0]) / STD[0]  # backbone mean/std
    np.testing.assert_allclose(x.numpy(), expected, atol=1e-5)
    ood_idx = data.split_indices()["ood"]
    assert set(raw.target[ood_idx]) == {3, 4} and len(data.dataset("ood")) == 364
    assert data.info.num_classes == 5 and data.eval_splits == ("test",)


def test_max_per_split_keeps_a_class_balanced_head():
    data = make(max_per_split=10)
    for split in ("train", "val", "test"):
        _, y = data.dataset(split).tensors
        assert np.bincount(y.numpy() % 5).tolist() == [2, 2, 2, 2, 2]
    _, y = data.dataset("ood").tensors  # digits 3 and 4
    assert np.bincount(y.numpy(), minlength=5).tolist() == [0, 0, 0, 5, 5]


def test_preprocessed_splits_are_cached_per_transform_and_never_shared_writable():
    from torchvision import transforms as T

    images, targets = digit_images(32)[0][:4], np.arange(4)
    calls = []

    class Counted(T.ToTensor):  # torchvision's repr ("Counted()"), counting its calls
        def __call__(self, pic):
            calls.append(1)
            return super().__call__(pic)

    digits_module._PREPROCESSED.clear()
    first = digits_module._tensors(images, targets, Counted())
    second = digits_module._tensors(images, targets, Counted())
    assert len(calls) == 4  # the second call preprocessed nothing
    assert torch.equal(first.tensors[0], second.tensors[0])
    expected = torch.as_tensor(images.transpose(0, 3, 1, 2) / 255, dtype=torch.float32)
    torch.testing.assert_close(second.tensors[0], expected)  # and is what the transform gives
    first.tensors[0].zero_()  # a job that writes into its inputs leaves the next job's alone
    assert torch.equal(digits_module._tensors(images, targets, Counted()).tensors[0], expected)
    # another transform is another entry; a transform known only by its address is not kept
    scaled = T.Compose([T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])
    torch.testing.assert_close(digits_module._tensors(images, targets, scaled).tensors[0],
                               (expected - 0.5) / 0.5)
    unnamed = digits_module._tensors(images, targets, lambda im: Counted()(im) * 2)
    torch.testing.assert_close(unnamed.tensors[0], expected * 2)
    assert len(digits_module._PREPROCESSED) == 2
    digits_module._PREPROCESSED.clear()


# --- corruptions -------------------------------------------------------------------------------

def test_corruption_splits_differ_more_from_clean_as_severity_grows():
    corruptions = ("gaussian_noise", "defocus_blur", "fog", "contrast")  # the config's default
    data = make(corruptions=list(corruptions))  # all 314 test images: fog 3 → 4 is close
    clean = data.dataset("test").tensors[0]
    assert data.eval_splits == ("test",) + tuple(
        f"test_c/{c}/{s}" for c in corruptions for s in range(1, 6))
    for c in corruptions:
        gaps = [float((data.dataset(f"test_c/{c}/{s}").tensors[0] - clean).abs().mean())
                for s in range(1, 6)]
        assert all(b > a for a, b in zip(gaps, gaps[1:], strict=False)), (c, gaps)
        assert torch.equal(data.dataset(f"test_c/{c}/1").tensors[1],
                           data.dataset("test").tensors[1])


def test_corruptions_are_seeded_cached_and_leave_the_global_generator_alone():
    images = digit_images(32)[0][:6]
    first = corrupt_images(images, "gaussian_noise", 3, seed=0)
    assert corrupt_images(images, "gaussian_noise", 3, seed=0) is first  # cached in memory
    digits_module._CORRUPTED.clear()
    np.random.seed(123)
    again = corrupt_images(images, "gaussian_noise", 3, seed=0)
    assert np.random.randint(1 << 30) == np.random.RandomState(123).randint(1 << 30)
    assert np.array_equal(first, again)  # recomputed: the same
    assert not np.array_equal(first, corrupt_images(images, "gaussian_noise", 3, seed=1))
    # one image alone is corrupted as it is among others (its own seed)
    assert np.array_equal(corrupt_images(images[2:3], "gaussian_noise", 3, seed=0)[0],
                          corrupt_images(images[:3], "gaussian_noise", 3, seed=0)[2])


def test_bad_corruption_or_severity_is_refused_before_anything_runs(compose_cfg, tmp_path):
    with pytest.raises(ValueError, match=r"'fogg'.*valid.*gaussian_noise.*glass_blur"):
        DigitsData(corruptions=["fog", "fogg"])
    with pytest.raises(ValueError, match=r"\[0, 6\].*valid: \[1, 2, 3, 4, 5\]"):
        DigitsData(severities=[0, 6])
    cfg = compose_cfg(["dataset=digits", "backbone=digits_vit_random", "method=single",
                       "dataset.corruptions=[snowy]", f"paths.runs_dir={tmp_path}"])
    with pytest.raises(ValueError, match="snowy"):
        run(cfg)
    assert not list(tmp_path.rglob("results.json"))


# --- pretraining and the checkpoint cache ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The `other` level's pipeline on 10 pretraining images for one epoch, and the indices of
    the images its training read."""
    from uqbench.runner.jobs import pretrain as module

    read = []
    original = module.ArrayImageDataset

    def spy(images, labels, transform, indices=None):
        read.append(np.asarray(indices))
        return original(images, labels, transform, indices)

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "ArrayImageDataset", spy)
        result = module.pretrain("other", cache, recipe=TINY, max_images=10, log=lambda s: None)
    return result, read


def test_pretraining_reads_only_pretraining_images_and_timm_vit_loads_the_weights(tiny):
    result, read = tiny
    assert result.built and result.weights.suffix == ".safetensors"
    _, labels = digit_images(32)
    splits = digits_splits(labels)
    assert len(read) == 1 and len(read[0]) == 10
    assert set(read[0]) <= set(splits["pretrain"])  # never ood, train, val or test
    saved = load_file(str(result.weights))
    encoder = TimmViT("digits_vit", MODEL, pretrained=True, checkpoint=str(result.weights),
                      model_kwargs=ARCHITECTURE).build()
    loaded = encoder.state_dict()
    assert set(saved) == set(loaded) and "blocks.3.mlp.fc2.weight" in saved
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    fresh = TimmViT("digits_vit", MODEL, pretrained=False, model_kwargs=ARCHITECTURE).build()
    assert not torch.equal(fresh.state_dict()["blocks.0.attn.qkv.weight"],
                           saved["blocks.0.attn.qkv.weight"])
    meta = json.loads(result.sidecar.read_text())
    assert meta["probe"]["n_train"] == meta["probe"]["n_eval"] == 10
    assert meta["probe"]["split"] == "val"  # levels are designed on validation, never test
    assert 0 <= meta["probe"]["acc"] <= 1 and meta["settings"]["recipe"] == TINY


def test_a_level_that_saw_the_downstream_kind_reads_only_the_kind_pool_besides(monkeypatch,
                                                                              tmp_path):
    from uqbench.runner.jobs import pretrain as module

    seen = {}

    def fake_train(recipe, split, seed, max_images, log):
        seen["idx"], seen["targets"], seen["classes"] = module.pretraining_images(
            recipe, split, max_images, seed)
        raise RuntimeError("stop")  # only the data matters here

    monkeypatch.setattr(module, "train_supervised", fake_train)
    with pytest.raises(RuntimeError, match="stop"):
        module.pretrain("foundation", tmp_path, seed=1)
    _, labels = digit_images(32)
    splits = digits_splits(labels)
    assert set(seen["idx"]) == set(splits["pretrain"]) | set(splits["kind"])  # 537 + 224
    assert seen["classes"] == 3 + 10  # digits 0–2, then 10 clusters of the kind pool
    assert not set(seen["idx"]) & (set(splits["train"]) | set(splits["val"])
                                   | set(splits["test"]) | set(splits["ood"]))
    # the kind pool's targets are k-means clusters of its pixels (scikit-learn's KMeans run
    # here, seeded by the pretraining seed), never its labels; the other digits keep theirs
    from sklearn.cluster import KMeans

    idx, targets = seen["idx"], seen["targets"]
    kind = np.isin(idx, splits["kind"])
    expected = KMeans(n_clusters=10, n_init=10, random_state=1).fit_predict(
        load_digits().data[idx[kind]])
    assert np.array_equal(targets[kind], 3 + expected)
    assert np.array_equal(targets[~kind], labels[idx[~kind]])  # 0, 1, 2
    # the first protocol: the kind pool by its labels, ten-way, beside 0–4
    first = {"split_seed": 0, "kind_fraction": 0.25}
    near, near_targets, classes = module.pretraining_images({"kind_images": 25}, first)
    extra = np.setdiff1d(near, digits_splits(labels, ood_classes=None)["pretrain"])
    assert classes == 10 and np.bincount(labels[extra], minlength=10)[5:].tolist() == [5] * 5
    assert np.array_equal(near_targets, labels[near])


def test_random_level_weights_follow_the_pretraining_seed_not_the_run_state(tmp_path):
    def qkv(seed: int, state: int) -> torch.Tensor:
        torch.manual_seed(state)  # whatever the runner drew before building
        return DigitsViT("r", "random", tmp_path, pretrain_seed=seed).build().state_dict()[
            "blocks.0.attn.qkv.weight"]

    assert torch.equal(qkv(1, 0), qkv(1, 99)) and not torch.equal(qkv(1, 0), qkv(2, 0))
    torch.manual_seed(1)  # what uqbench-pretrain probes for the random level with seed 1
    probed = TimmViT("digits_vit", MODEL, pretrained=False, model_kwargs=ARCHITECTURE).build()
    assert torch.equal(probed.state_dict()["blocks.0.attn.qkv.weight"], qkv(1, 5))


def test_second_call_reuses_the_cache_without_training(tiny, monkeypatch):
    from uqbench.runner.jobs import pretrain as module

    result, _ = tiny
    mtime = result.weights.stat().st_mtime_ns
    monkeypatch.setattr(module, "train_supervised", lambda *a, **k: pytest.fail("trained"))
    again = module.pretrain("other", result.weights.parents[1], recipe=TINY, max_images=10)
    assert not again.built and again.weights == result.weights
    assert result.weights.stat().st_mtime_ns == mtime and again.meta == result.meta


def _as_other_level(tiny, cache) -> DigitsViT:
    """A DigitsViT `other` backbone whose cache holds the tiny checkpoint at its expected path."""
    backbone = DigitsViT("digits_vit_other", "other", cache_dir=cache)
    weights, sidecar = checkpoint_paths(cache, backbone.settings)
    weights.parent.mkdir(parents=True)
    shutil.copy(tiny[0].weights, weights)
    shutil.copy(tiny[0].sidecar, sidecar)
    return backbone


def test_equal_weights_are_written_as_equal_files_in_every_process(tmp_path):
    """The recorded sha256 names the weights: written in separate processes (whose map order
    differs), the same weights and settings give the same bytes."""
    import hashlib
    import subprocess
    import sys

    script = ("import sys, torch; from pathlib import Path; "
              "from uqbench.backbones.digits_vit import write_weights; "
              "torch.manual_seed(0); "
              "state = {n: torch.randn(3, 4) for n in ('blocks.0.w', 'cls_token', 'norm.b')}; "
              "write_weights(state, Path(sys.argv[1]), {'level': 'x', 'seed': 0, 'b': [1, 2]})")
    digests = set()
    for k in range(3):
        path = tmp_path / f"w{k}.safetensors"
        subprocess.run([sys.executable, "-c", script, str(path)], check=True)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1, digests
    assert load_file(str(tmp_path / "w0.safetensors"))["cls_token"].shape == (3, 4)


def test_truncated_checkpoint_is_refused_naming_the_file(tiny, tmp_path):
    from uqbench.runner.jobs.pretrain import pretrain

    backbone = _as_other_level(tiny, tmp_path)
    assert backbone.build()(torch.zeros(2, 3, 32, 32)).shape == (2, 64)  # intact: loads
    data = backbone.checkpoint.read_bytes()
    backbone.checkpoint.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError) as err:
        backbone.build()
    assert str(backbone.checkpoint) in str(err.value)
    assert f"uqbench-pretrain other --seeds 0 --cache-dir {tmp_path} --force" in str(err.value)
    # the pretraining command refuses it too, instead of silently reusing it
    cache = tmp_path / "own"
    shutil.copytree(tiny[0].weights.parent, cache / "digits_vit")
    weights = cache / "digits_vit" / tiny[0].weights.name
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointCorruptError, match=str(weights)):
        pretrain("other", cache, recipe=TINY, max_images=10)


def test_missing_checkpoint_names_the_command_that_builds_it(tmp_path):
    backbone = DigitsViT("digits_vit_other", "other", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError,
                       match=f"uqbench-pretrain other --seeds 0 --cache-dir {tmp_path}"):
        backbone.build()
    assert DigitsViT("r", "random", cache_dir=tmp_path).build()  # needs no checkpoint
    with pytest.raises(ValueError, match="'medium'.*random, other, near, foundation"):
        DigitsViT("m", "medium", cache_dir=tmp_path)


def test_dataset_refuses_a_backbone_pretrained_on_another_split(tmp_path):
    with pytest.raises(ValueError, match="'split_seed': 1.*dataset.split_seed"):
        DigitsData(corruptions=None).setup(DigitsViT("w", "other", tmp_path, split_seed=1))
    with pytest.raises(ValueError, match="'kind_fraction': 0.2.*dataset.kind_fraction"):
        DigitsData(corruptions=None).setup(DigitsViT("w", "other", tmp_path, kind_fraction=0.2))
    DigitsData(corruptions=None).setup(DigitsViT("r", "random", tmp_path, split_seed=1))


def test_pretrain_command_prints_the_probe_and_refuses_unknown_levels(tmp_path, capsys):
    from uqbench.runner.jobs.pretrain import main

    main(["random", "--seeds", "0", "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    (sidecar,) = (tmp_path / "digits_vit").glob("random-s0-*.json")
    acc = json.loads(sidecar.read_text())["probe"]["acc"]
    assert "random" in out and "built" in out and f"{acc:.3f}" in out
    main(["random", "--seeds", "0", "--cache-dir", str(tmp_path)])
    assert "cached" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["medium", "--cache-dir", str(tmp_path)])
    assert "medium" in capsys.readouterr().err


# --- the runner --------------------------------------------------------------------------------

def test_digits_runs_end_to_end_through_the_runner(compose_cfg, tmp_path):
    cfg = compose_cfg([
        "dataset=digits", "backbone=digits_vit_random", "method=sve", "method.members=2",
        "trainer=p1", "trainer.epochs=1", "trainer.progress=false", "dataset.max_per_split=15",
        "dataset.corruptions=[gaussian_noise,contrast]", "dataset.severities=[1,5]",
        f"paths.runs_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache", "torch_threads=1",
        "plot=false"])
    results = run(cfg)
    written = json.loads((tmp_path / cfg.run_subdir / "results.json").read_text())
    metrics = written["metrics"]
    assert {"test/acc", "ood/auroc_mi", "test_c/mean/acc",
            "test_c/contrast/5/acc"} <= set(metrics) and metrics == results["metrics"]
    expected = np.mean([metrics[f"test_c/{c}/{s}/acc"]
                        for c in ("gaussian_noise", "contrast") for s in (1, 5)])
    assert metrics["test_c/mean/acc"] == pytest.approx(expected)
    assert written["settings"]["dataset"]["sizes"] == {"train": 15, "val": 15, "test": 15,
                                                       "ood": 15}
