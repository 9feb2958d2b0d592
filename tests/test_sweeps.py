"""Which runs an experiment's sweep asks for, and the done/missing report of `make p1-tables`."""

from __future__ import annotations

import pytest

from uqbench.report.sweeps import expected_runs, main, report, sweep_jobs


def test_sweep_jobs_expand_every_axis():
    jobs = sweep_jobs("p1_backbone_ablation")            # 3 backbones × 2 methods × 3 seeds
    assert len(jobs) == 18 and ["backbone=vits16_random", "method=sve", "seed=0"] in jobs
    assert len(sweep_jobs("p1_ensemble_size")) == 27       # 3 methods × M ∈ {4, 8, 16} × 3 seeds


def test_report_counts_finished_runs_and_names_the_missing(tmp_path, capsys):
    runs = expected_runs("p1_sst2", tmp_path)             # 3 methods × 3 seeds, M = 8
    folders = {path for _, path in runs}
    assert len(folders) == 9
    assert tmp_path / "p1_sst2/sst2/sve_m8/bert_base/seed2" in folders
    done = next(path for job, path in runs if "method=sve" in job)
    done.mkdir(parents=True)
    (done / "results.json").write_text("{}")
    assert report("p1_sst2", tmp_path) == (1, 9)
    out = capsys.readouterr().out
    assert "p1_sst2: 1/9 runs done" in out and "uqbench experiment=p1_sst2 method=" in out


def test_unknown_experiment_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["p1_nope", "--runs", "/nonexistent"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown experiment(s) p1_nope; valid: ")
    assert "p1_nope" in err and "p1_flowers102" in err
