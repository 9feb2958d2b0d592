"""Deep Ensemble members as separate jobs (method.member=k), combined by uqbench-combine.

Two members of a tiny ViT ensemble are trained as two jobs and compared with the same
ensemble trained in one process, and the combined metrics with metrics recomputed here from
the member probabilities with numpy, scipy and scikit-learn.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp, softmax
from sklearn.metrics import roc_auc_score

from tests.helpers import build_method, run_cli
from uqbench.identity import identity
from uqbench.runner.jobs.combine import combine

# Dropout off: it draws random numbers while training, from one stream in the one-process run
# and one per job, and would then change the members (and the later batch orders). The clip
# and learning rate make clipping act on some steps and not on others: had a member job
# trained on CE_k instead of its share CE_k / M, its probabilities would differ from the
# one-process member's by up to 0.038 here (measured), not ~1e-7.
COMMON = ("backbone=tiny_vit", "dataset=fake_images", "method=deep_ensemble",
          "method.members=2", "trainer=p1", "trainer.epochs=2", "trainer.warmup_epochs=0",
          "trainer.optimizer.lr=0.01", "trainer.grad_clip=3.0", "trainer.select=last",
          "trainer.progress=false", "torch_threads=1", "backbone.model_kwargs.proj_drop_rate=0")
LEVEL = ("backbone.model_kwargs.proj_drop_rate=0,trainer.epochs=2,trainer.grad_clip=3.0,"
         "trainer.optimizer.lr=0.01,trainer.select=last,trainer.warmup_epochs=0,trainer=p1")
# float32 rounding of 2 epochs × 4 steps (the one-process head is one batched product over
# the M sets and its loss one mean over M·B rows): measured ≤ 1.2e-7 on probabilities
ATOL = 1e-6


def member_level(k: int) -> str:
    """The member's override level: the one-process level with method.member=k, sorted in."""
    return ",".join(sorted([*LEVEL.split(","), f"method.member={k}"]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """The two members as separate jobs (one sweep of the CLI), and the one-process ensemble
    (run here, in the folder the CLI gives it: LEVEL, as the member folders show)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from uqbench.runner.cli import run

    runs = tmp_path_factory.mktemp("members") / "runs"
    run_cli("-m", *COMMON, f"paths.runs_dir={runs}", "method.member=0,1")
    base = runs / "default/fake_images/de_m2/tiny_vit"
    GlobalHydra.instance().clear()
    threads = torch.get_num_threads()
    try:
        with initialize_config_module("uqbench.conf", version_base="1.3"):
            run(compose("config", overrides=[
                *COMMON, f"paths.runs_dir={runs}",
                f"run_name='{base.relative_to(runs) / LEVEL / 'seed0'}'"]))
    finally:
        GlobalHydra.instance().clear()
        torch.set_num_threads(threads)
    return {"runs": runs, "joint": base / LEVEL / "seed0",
            0: base / member_level(0) / "seed0", 1: base / member_level(1) / "seed0"}


def probs(folder: Path, split: str) -> np.ndarray:
    return np.load(folder / "predictions" / f"{split}.npz")["member_probs"]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# --- one member per job ---------------------------------------------------------------------

def test_member_jobs_train_exactly_the_members_of_the_one_process_ensemble(trained):
    joint = trained["joint"]
    assert (joint / "results.json").is_file()
    for k in (0, 1):
        folder = trained[k]  # the sweep gave each member its own method.member=k level
        results = json.loads((folder / "results.json").read_text())
        assert results["settings"]["method"]["member"] == k
        assert results["settings"]["method"]["members"] == 2
        assert results["params"]["heads"] == 4 * 16 + 4  # one head: C × D weights + C biases
        for split in ("test", "val", "ood"):
            own, together = probs(folder, split), probs(joint, split)
            assert own.shape == (1, *together.shape[1:])
            np.testing.assert_allclose(own[0], together[k], rtol=0, atol=ATOL)
    assert np.abs(probs(trained[0], "test")[0] - probs(trained[1], "test")[0]).max() > 1e-2


def test_combined_ensemble_is_the_one_process_run(trained, tmp_path):
    members = [trained[0], trained[1]]
    # by default the ensemble goes where the one-process run of the same config went, and is
    # that configuration: the run is refused as existing, not as another configuration
    with pytest.raises(FileExistsError, match="already exists for this configuration"):
        combine(members)
    out, results = combine(members, out=tmp_path / "combined")
    joint = json.loads((trained["joint"] / "results.json").read_text())
    assert set(results["metrics"]) == set(joint["metrics"])
    for key, value in joint["metrics"].items():
        # conformal sets are thresholds on scores (aps: on class ranks), and this two-epoch
        # model's nearly uniform probabilities let the two runs' last-bit differences move
        # examples and classes across them: their sets are compared through q̂ below
        if "/cp" not in key:
            assert results["metrics"][key] == pytest.approx(value, abs=1e-5), key
    assert results["calibration"]["conformal_thr"] == pytest.approx(
        joint["calibration"]["conformal_thr"], abs=1e-5)
    assert results["calibration"]["temperature"] == pytest.approx(
        joint["calibration"]["temperature"], rel=1e-4)
    assert results["params"] == joint["params"]  # two full copies: 2 × (encoder + head)
    assert results["settings"] == joint["settings"]
    assert results["run"] == str(tmp_path / "combined")  # where they are, with --out
    assert [Path(r).parent.name for r in results["combined_from"]] == [member_level(0),
                                                                         member_level(1)]
    assert results["time"]["train_s"] == pytest.approx(sum(
        json.loads((m / "results.json").read_text())["time"]["train_s"] for m in members))
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert identity(stored) == identity(yaml.safe_load(
        (trained["joint"] / "config.yaml").read_text()))
    for split in ("test", "val", "ood"):
        np.testing.assert_allclose(probs(out, split), probs(trained["joint"], split), atol=ATOL)
    # the runner's rules: kept unless asked, replaced with --overwrite
    with pytest.raises(FileExistsError, match="--overwrite"):
        combine(members, out=out)
    assert combine(members, out=out, skip_existing=True)[1]["metrics"] == results["metrics"]
    assert combine(members, out=out, overwrite=True)[1]["metrics"] == results["metrics"]


def test_combined_metrics_match_an_independent_computation(trained, tmp_path):
    _, results = combine([trained[1], trained[0]], out=tmp_path / "combined")  # any order
    metrics = results["metrics"]
    split = {s: [np.load(trained[k] / "predictions" / f"{s}.npz") for k in (0, 1)]
             for s in ("test", "val", "ood")}
    member = {s: np.concatenate([z["member_probs"] for z in split[s]]).astype(np.float64)
              for s in split}                                               # (2, N, C)
    y = {s: split[s][0]["labels"] for s in split}
    p = member["test"].mean(0)                                              # (N, C)
    n = np.arange(len(y["test"]))
    assert metrics["test/acc"] == pytest.approx(np.mean(p.argmax(1) == y["test"]), abs=1e-12)
    assert metrics["test/nll"] == pytest.approx(-np.mean(np.log(p[n, y["test"]])), abs=1e-6)
    onehot = np.eye(p.shape[1])[y["test"]]
    assert metrics["test/brier"] == pytest.approx(np.mean(((p - onehot) ** 2).sum(1)), abs=1e-6)

    def mutual_information(m: np.ndarray) -> np.ndarray:
        entropy = lambda q: -(q * np.log(q)).sum(-1)  # noqa: E731
        return entropy(m.mean(0)) - entropy(m).mean(0)

    scores = np.concatenate([mutual_information(member["test"]),
                             mutual_information(member["ood"])])
    is_ood = np.r_[np.zeros(len(y["test"])), np.ones(len(y["ood"]))]
    assert metrics["ood/auroc_mi"] == pytest.approx(roc_auc_score(is_ood, scores), abs=1e-6)
    # temperature refitted on the combined validation predictions: scipy's 1-D minimiser
    log_val = np.log(member["val"])

    def val_nll(log_t: float) -> float:
        tempered = softmax(log_val / np.exp(log_t), axis=-1)                # (2, N, C)
        mixture = logsumexp(np.log(tempered), axis=0) - np.log(2)
        return -np.mean(mixture[np.arange(len(y["val"])), y["val"]])

    best = minimize_scalar(val_nll, bounds=(np.log(0.01), np.log(100)), method="bounded",
                           options={"xatol": 1e-10})
    assert results["calibration"]["temperature"] == pytest.approx(np.exp(best.x), rel=1e-4)


# --- what cannot be combined ----------------------------------------------------------------

def copy_members(trained, tmp_path) -> list[Path]:
    """The member folders copied (without their lock files), to be spoiled."""
    copies = []
    for k in (0, 1):
        target = tmp_path / "runs" / member_level(k) / "seed0"
        shutil.copytree(trained[k], target)
        copies.append(target)
    return copies


def spoil_config(folder: Path, **changes) -> None:
    path = folder / "config.yaml"
    config = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        node = config
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path.write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("case,error,match", [
    ("missing", FileNotFoundError, r"member 1 of the 2-member ensemble is missing \(given: 0\)"
                                   r".*method\.member=1"),
    ("duplicate", ValueError, r"member 0: .*method\.member=0,.*seed0, .*copy0"),
    ("other_config", ValueError, r"trainer\.optimizer\.lr: 0\.01 in .*, 0\.02 in "),
    ("no_predictions", FileNotFoundError, r"save_predictions=false"),
    ("lost_prediction", FileNotFoundError, r"predictions/ood\.npz is missing"),
    ("not_a_member", ValueError, r"is not a member job"),
])
def test_combine_refuses_what_is_not_one_complete_ensemble(trained, tmp_path, case, error,
                                                          match):
    members = copy_members(trained, tmp_path)
    if case == "missing":
        members = members[:1]
    elif case == "duplicate":
        shutil.copytree(members[0], tmp_path / "runs" / "copy0")
        members = [members[0], tmp_path / "runs" / "copy0", members[1]]
    elif case == "other_config":
        spoil_config(members[1], trainer__optimizer__lr=0.02)
    elif case == "no_predictions":
        shutil.rmtree(members[1] / "predictions")
        spoil_config(members[1], save_predictions=False)
    elif case == "lost_prediction":
        (members[1] / "predictions" / "ood.npz").unlink()
    else:
        shutil.copytree(trained["joint"], tmp_path / "runs" / "joint")
        members = [members[0], tmp_path / "runs" / "joint"]
    before = snapshot(tmp_path)
    with pytest.raises(error, match=match):
        combine(members)
    assert snapshot(tmp_path) == before  # nothing written, nothing deleted


def test_the_command_takes_a_glob_and_fails_in_one_line(trained, tmp_path, capsys):
    from uqbench.runner.jobs.combine import main

    members = copy_members(trained, tmp_path)
    main([str(tmp_path / "runs" / "*method.member=*" / "seed0")])
    out = tmp_path / "runs" / LEVEL / "seed0"  # the member level removed
    results = json.loads((out / "results.json").read_text())
    assert results["run"] == json.loads((trained["joint"] / "results.json").read_text())["run"]
    assert len(results["combined_from"]) == 2
    assert probs(out, "test").shape[0] == 2
    assert capsys.readouterr().out.startswith(f"{out}: test/acc=")
    with pytest.raises(SystemExit) as exit_:
        main([str(members[0])])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: member 1 of the 2-member ensemble is missing (given: 0)")
    assert "Traceback" not in err


# --- the method and its config ---------------------------------------------------------------

@pytest.mark.parametrize("method", ["deep_ensemble", "deep_ensemble_lp"])
def test_member_k_starts_as_member_k_and_counts_add_up_to_the_ensemble(cfg, method):
    """Built under the same seed, member job k holds exactly member k's head and encoder copy
    of the 3-member ensemble, and the members' parameter counts combine into the ensemble's."""
    ensemble, _ = build_method(cfg, "tiny_vit", method, "method.members=3")
    parts = [build_method(cfg, "tiny_vit", method, "method.members=3", f"method.member={k}")[0]
             for k in range(3)]
    for k, part in enumerate(parts):
        assert part.head.weight.shape[0] == 1
        assert torch.equal(part.head.weight[0], ensemble.head.weight[k])
        assert torch.equal(part.head.bias[0], ensemble.head.bias[k])
        if method == "deep_ensemble":
            own = dict(part.de_encoders[0].named_parameters())
            for name, p in ensemble.de_encoders[k].named_parameters():
                assert torch.equal(own[name], p), name
    combined = type(ensemble).combine_param_counts([p.param_counts() for p in parts],
                                                   finetune=method == "deep_ensemble")
    assert combined == ensemble.param_counts()


@pytest.mark.parametrize("overrides,match", [
    (["method.member=2"], r"method\.member=2 is not a member of an ensemble of "
                          r"method\.members=2: give an integer from 0 to 1"),
    (["method.member=-1"], r"method\.member=-1 .* from 0 to 1"),
    (["method.member=one"], r"method\.member must be an integer"),
    (["method=sve", "+method.member=0"], r"method\.member is not an option of method 'SVE'; "
                                         r"the method options that have it: deep_ensemble, "
                                         r"deep_ensemble_independent, deep_ensemble_lp"),
])
def test_bad_members_are_refused_before_anything_is_built(compose_cfg, overrides, match):
    from uqbench.runner.spec import check_config

    cfg = compose_cfg(["backbone=tiny_vit", "dataset=fake_images", "method=deep_ensemble",
                       "method.members=2", *overrides])
    with pytest.raises(ValueError, match=match):
        check_config(cfg)


def test_tables_leave_member_runs_to_their_ensemble(trained):
    from uqbench.report.validation import load_results

    runs = [r["run"] for r in load_results(trained["runs"])]
    assert runs == [json.loads((trained["joint"] / "results.json").read_text())["run"]]


def test_job_eval_scores_a_combined_ensemble_from_its_members_checkpoints(trained, tmp_path):
    out, results = combine([trained[0], trained[1]], out=tmp_path / "combined")
    assert not (out / "checkpoint.ckpt").exists()  # the members keep theirs
    shell = tmp_path / "shell"  # the folder the command runs in: its runs/ stays untouched
    shell.mkdir()
    run_cli("job=eval", f"eval_run='{out}'", cwd=shell)
    # the job's log is the scoring's, beside its results, not in the default config's folder
    log = (out / "eval" / "fake_images" / "uqbench.log").read_text()
    assert f"wrote {out}/eval/fake_images/results.json" in log
    assert list(shell.iterdir()) == []
    scored = json.loads((out / "eval" / "fake_images" / "results.json").read_text())
    assert scored["scored_from"] == [str(trained[0]), str(trained[1])]
    assert scored["metrics"] == results["metrics"]
    np.testing.assert_array_equal(
        np.load(out / "eval" / "fake_images" / "predictions" / "test.npz")["member_probs"],
        probs(out, "test"))


def test_a_refused_scoring_leaves_no_folder_in_the_run_or_where_it_ran(trained, tmp_path):
    """Hydra makes the scoring's folder for its log before the job checks the command; a
    refused job (a training setting a scoring cannot change) removes it again, and the run
    keeps exactly its files."""
    before = sorted(p.relative_to(trained[0]) for p in trained[0].rglob("*"))
    proc = run_cli("job=eval", f"eval_run='{trained[0]}'", "trainer.epochs=7", cwd=tmp_path,
                   check=False)
    assert proc.returncode == 1 and "job=eval scores the run as it was trained" in proc.stderr
    assert sorted(p.relative_to(trained[0]) for p in trained[0].rglob("*")) == before
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_combined_ensemble_logs_to_its_members_tracker(trained, tmp_path):
    """Members trained with logger=wandb: the combined ensemble gets its W&B record too, job
    type combine, holding the ensemble's metrics."""
    import json
    import subprocess
    import sys

    wandb_dir = tmp_path / "tracker"
    members = copy_members(trained, tmp_path)
    for folder in members:
        spoil_config(folder, logger={"_target_": "uqbench.records.loggers.WandbLogger",
                                     "mode": "offline", "dir": str(wandb_dir)})
    _, results = combine(members, out=tmp_path / "combined")
    (offline,) = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    wandb = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(wandb), "leet", "inspect", "--json", str(offline)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines()]
    (record,) = [r["run"] for r in records if r.get("type") == "run"]
    assert record["job_type"] == "combine"
    state = json.loads(subprocess.run(
        [str(wandb), "leet", "inspect", "--summary", "--json", str(offline)],
        capture_output=True, text=True, timeout=120, check=True).stdout)
    assert state["summary"]["test/nll"] == pytest.approx(results["metrics"]["test/nll"])
    assert state["summary"]["params/trainable"] == results["params"]["trainable"]
