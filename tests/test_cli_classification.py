"""The `uqbench` CLI end to end for every classification method on tiny backbones and fake
data (one Hydra multirun per modality), and the overhead job with its table."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score
from torchmetrics.classification import MulticlassCalibrationError

from tests.helpers import run_cli
from uqbench.report.tables import write_tables

FAST = ["trainer.epochs=1", "trainer.val_every=1", "trainer.progress=false", "logger=none",
        "plot=false", "torch_threads=1"]
# FAST's overrides that change a result make one more folder level, keys sorted (by hand)
FAST_DIR = "trainer.epochs=1,trainer.val_every=1"
IMAGE_RUNS = {"sve": ("sve_m4", 4), "svf": ("svf", 1), "lora_ensemble": ("lora_m4_r8", 4),
              "batch_ensemble": ("be_m4", 4), "blob": ("blob_s10_r8", 10),
              "map_lora": ("map_lora_r8", 1), "deep_ensemble": ("de_m4", 4),
              "deep_ensemble_lp": ("de_lp_m4", 4), "mc_dropout": ("mcdo_t10_p0.1", 10),
              "single": ("single", 1)}


def recompute(member_probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """acc, nll, brier, ece of the mixture from scikit-learn, torchmetrics and numpy."""
    p = member_probs.astype(np.float64).mean(0)
    p /= p.sum(-1, keepdims=True)
    classes = list(range(p.shape[1]))
    ece = MulticlassCalibrationError(num_classes=p.shape[1], n_bins=15, norm="l1")
    return {"acc": float((p.argmax(1) == labels).mean()),
            "nll": log_loss(labels, p, labels=classes),
            "brier": brier_score_loss(labels, p, labels=classes, scale_by_half=False),
            "ece": ece(torch.from_numpy(p), torch.from_numpy(labels)).item()}


def mutual_information(member_probs: np.ndarray) -> np.ndarray:
    def h(p):
        return -(p * np.log(np.clip(p, 1e-300, None))).sum(-1)
    p = member_probs.astype(np.float64)
    return h(p.mean(0)) - h(p).mean(0)


@pytest.fixture(scope="module")
def image_runs(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    run_cli("-m", "backbone=tiny_vit", "dataset=fake_images", f"method={','.join(IMAGE_RUNS)}",
            f"paths.runs_dir={runs}", *FAST)
    return runs


@pytest.mark.parametrize("method", list(IMAGE_RUNS))
def test_each_method_runs_end_to_end_and_its_metrics_recompute(image_runs, method):
    name, members = IMAGE_RUNS[method]
    run_dir = image_runs / "default/fake_images" / name / "tiny_vit" / FAST_DIR / "seed0"
    res = json.loads((run_dir / "results.json").read_text())
    assert (res["method"], res["backbone"], res["dataset"]) == (method, "tiny_vit", "fake_images")
    assert res["settings"]["method"]["members"] == members
    assert res["params"]["trainable"] > 0 and res["params"]["base"] > 0
    test = np.load(run_dir / "predictions/test.npz")
    ood = np.load(run_dir / "predictions/ood.npz")
    assert test["member_probs"].shape == (members, 32, 4) and test["labels"].shape == (32,)
    for key, value in recompute(test["member_probs"], test["labels"]).items():
        assert res["metrics"][f"test/{key}"] == pytest.approx(value, abs=1e-5), key
    is_ood = np.r_[np.zeros(32), np.ones(32)]
    if members == 1:  # the mutual information of one member is 0 for every input
        assert "ood/auroc_mi" not in res["metrics"]
    else:
        mi = np.concatenate([mutual_information(test["member_probs"]),
                             mutual_information(ood["member_probs"])])
        assert res["metrics"]["ood/auroc_mi"] == pytest.approx(roc_auc_score(is_ood, mi),
                                                               abs=1e-6)
    energy = -logsumexp(np.concatenate([test["mean_logits"], ood["mean_logits"]]), axis=-1)
    assert res["metrics"]["ood/auroc_energy"] == pytest.approx(roc_auc_score(is_ood, energy),
                                                               abs=1e-6)
    # temperature scaling fitted on val, applied to test: recomputed from the saved predictions
    t = res["calibration"]["temperature"]
    log_p = np.log(np.maximum(test["member_probs"].astype(np.float64), 1e-38)) / t
    tempered = np.exp(log_p - log_p.max(-1, keepdims=True))
    tempered /= tempered.sum(-1, keepdims=True)
    for key, value in recompute(tempered, test["labels"]).items():
        assert res["metrics"][f"test/ts/{key}"] == pytest.approx(value, abs=1e-5), key
    val = np.load(run_dir / "predictions/val.npz")
    # conformal thr sets at 90 %: q is the ⌈(n + 1)·0.9⌉-th smallest 1 − p̄(y) on val
    val_mean = val["member_probs"].astype(np.float64).mean(0)
    scores = np.sort(1 - val_mean[np.arange(len(val["labels"])), val["labels"]])
    q = scores[math.ceil((len(scores) + 1) * 0.9) - 1] if len(scores) >= 9 else np.inf
    sets = 1 - test["member_probs"].astype(np.float64).mean(0) <= q + 1e-12
    assert res["metrics"]["test/cp_thr/coverage"] == pytest.approx(
        sets[np.arange(32), test["labels"]].mean())
    assert res["metrics"]["test/cp_thr/set_size"] == pytest.approx(sets.sum(1).mean())
    raw_val_nll = recompute(val["member_probs"], val["labels"])["nll"]
    assert res["metrics"]["val/ts/nll"] <= raw_val_nll + 1e-6
    assert res["cost"]["forward_flops_per_example"] > 0


@pytest.mark.slow
def test_text_methods_run_end_to_end_on_tiny_bert_and_llama(tmp_path):
    run_cli("-m", "backbone=tiny_bert,tiny_llama", "dataset=fake_text",
            "method=sve,lora_ensemble", f"paths.runs_dir={tmp_path}", *FAST)
    for backbone in ("tiny_bert", "tiny_llama"):
        for name in ("sve_m4", "lora_m4_r8"):
            run_dir = tmp_path / "default/fake_text" / name / backbone / FAST_DIR / "seed0"
            res = json.loads((run_dir / "results.json").read_text())
            test = np.load(run_dir / "predictions/test.npz")
            assert test["member_probs"].shape == (4, 32, 2)
            assert res["metrics"]["test/nll"] == pytest.approx(
                recompute(test["member_probs"], test["labels"])["nll"], abs=1e-5)


@pytest.mark.slow
def test_overhead_job_writes_params_and_the_table_shows_the_paper(tmp_path):
    run_cli("-m", "experiment=p1_overhead", "backbone=bert_base", "method=sve,deep_ensemble",
            f"paths.runs_dir={tmp_path}")
    res = json.loads((tmp_path / "p1_overhead/none/sve_m8/bert_base/seed0/results.json")
                     .read_text())
    assert res["params"]["added"] == 8 * 12 * 15 * 768 and res["metrics"] == {}
    assert not (tmp_path / "p1_overhead/none/sve_m8/bert_base/seed0/predictions").exists()
    md = write_tables(tmp_path, tmp_path / "tables", "p1_overhead")["p1_overhead"].read_text()
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
             if line.startswith("|")]
    header, rows = lines[0], {row[1]: dict(zip(lines[0], row, strict=True)) for row in lines[2:]}
    assert {"overhead %", "overhead % (paper)"} <= set(header)
    assert float(rows["sve"]["overhead %"]) == pytest.approx(1.01)        # ours
    assert float(rows["sve"]["overhead % (paper)"]) == pytest.approx(1.0)  # P1's ≈ 1.0 %
    assert float(rows["deep_ensemble"]["overhead %"]) == pytest.approx(700)
    assert float(rows["deep_ensemble"]["overhead % (paper)"]) == pytest.approx(700)
    # the training-memory estimate lands in results.json and in the table
    memory = res["memory"]
    assert memory["batch_size"] == 16 and memory["optimizer"] == "AdamW"   # P1's recipe
    assert rows["sve"]["FSDP 8 GPUs (per GPU)"] == \
        f"{memory['layouts']['fsdp8']['bytes']['total'] / 1e9:.1f}"
    assert rows["sve"]["train GB 1 GPU"] == f"{memory['bytes']['total'] / 1e9:.1f}"


@pytest.mark.slow
def test_paper_table_shows_ours_beside_the_papers(tmp_path):
    """experiment=p1_flowers102 end to end on a Flowers102 fixture with a tiny backbone: the
    table has our numbers and P1's reference numbers side by side."""
    from tests.fixtures.datasets import write_flowers102

    write_flowers102(tmp_path / "data", split_sizes=(8, 4, 6))
    run_cli("experiment=p1_flowers102", "backbone=tiny_vit", "method=single,sve", "seed=0",
            "trainer.epochs=1", "trainer.warmup_epochs=0", "dataset.num_workers=0",
            "trainer.progress=false", "torch_threads=1",
            f"paths.data_root={tmp_path / 'data'}", f"paths.runs_dir={tmp_path / 'runs'}")
    written = write_tables(tmp_path / "runs", tmp_path / "tables", "p1_flowers102")
    md = written["p1_flowers102"].read_text()
    header = next(line for line in md.splitlines() if line.startswith("| method"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:4] == ["method", "M", "ACC", "ACC (paper)"]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")]
            for r in md.splitlines() if r.startswith("| s")}
    assert set(rows) == {"single", "sve"}
    assert rows["sve"][cols.index("ACC (paper)")] == "95.4"
    assert rows["single"][cols.index("Brier (paper)")] == "0.20"
    run_dir = (tmp_path / "runs/p1_flowers102/flowers102/sve_m4/tiny_vit"
               / "dataset.num_workers=0,trainer.epochs=1,trainer.warmup_epochs=0/seed0")
    res = json.loads((run_dir / "results.json").read_text())
    ours = rows["sve"][cols.index("ACC")]
    assert float(ours) == pytest.approx(100 * res["metrics"]["test/acc"], abs=0.051)


@pytest.mark.slow
@pytest.mark.parametrize("overrides,expected", [
    (["backbone=tiny_vit", "dataset.image_size=20"],
     ["dataset.image_size=20", "16×16", "backbone.model_kwargs.img_size=20"]),
    (["backbone=tiny_bert"], ["modalities do not match", "image", "tiny_vit"]),
    (["backbone=tiny_vit", "dataset=fake_text"], ["modalities do not match", "text", "bert_base"]),
])
def test_data_the_backbone_cannot_take_is_refused_before_training(tmp_path, overrides,
                                                                  expected):
    proc = run_cli("dataset=fake_images", "method=single", *overrides,
                   f"paths.runs_dir={tmp_path}", *FAST, check=False)
    assert proc.returncode == 1
    for word in expected:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("results.json"))


@pytest.mark.slow
@pytest.mark.parametrize("content", ["garbage", "other model"])
def test_a_broken_checkpoint_is_named_not_a_traceback(tmp_path, content):
    """Garbage bytes or another model's weights in the checkpoint file: one line naming it."""
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    if content == "garbage":
        path.write_bytes(b"\x00\xff not a safetensors file" * 10)
    else:
        save_file({"weight": torch.zeros(3, 3)}, str(path))
    proc = run_cli("backbone=tiny_vit", "backbone.pretrained=true",
                   f"backbone.checkpoint={path}", "dataset=fake_images", "method=single",
                   f"paths.runs_dir={tmp_path / 'runs'}", *FAST, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"cannot load the pretrained weights in {path}" in proc.stderr
    assert "corrupt, truncated or holds another model's weights" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "runs").rglob("results.json"))
