"""Tables take their layout from the experiment's config: an edited title redraws finished runs,
and neither it nor an edited lookup entry the runs did not read makes them run again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from uqbench.records.runfolder import ConfigMismatchError
from uqbench.report.tables import write_tables
from uqbench.runner.cli import run

EXPERIMENT = """# @package _global_
experiment_name: tiny_layout
trainer:
  optimizer:
    lr: ${lookup.rates.${method.variance}}
lookup:
  rates: {embedded: 0.01, learned: 0.02, unused: UNUSED}
table:
  title: "TITLE"
  rows:
    - {key: settings.method.variance, title: variance}
  columns:
    - {key: metrics.test/nll, title: NLL, fmt: ".3f"}
"""
TINY = ["dataset.n_train=60", "dataset.n_val=20", "dataset.n_test=20", "dataset.n_ood=20",
        "backbone.width=4", "trainer.epochs=1", "trainer.progress=false", "torch_threads=1",
        "plot=false", "logger=none"]


def _experiment(conf: Path, title: str, unused: float = 0.5) -> None:
    (conf / "experiment").mkdir(parents=True, exist_ok=True)
    (conf / "experiment" / "tiny_layout.yaml").write_text(
        EXPERIMENT.replace("TITLE", title).replace("UNUSED", str(unused)))


def _run(conf: Path, runs: Path, variance: str, *extra: str) -> dict:
    """One tiny run of the experiment in the user's config folder (composed as the CLI does)."""
    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        cfg = compose("config", overrides=[
            "experiment=tiny_layout", f"hydra.searchpath=[file://{conf}]",
            f"method.variance={variance}", f"paths.runs_dir={runs}", *TINY, *extra])
    return run(cfg)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, one_thread) -> tuple[Path, Path, dict[Path, bytes]]:
    """(config folder, runs folder, {results.json: bytes}) after two tiny runs."""
    root = tmp_path_factory.mktemp("layout")
    conf, runs = root / "conf", root / "runs"
    _experiment(conf, "first title")
    for variance in ("embedded", "learned"):
        _run(conf, runs, variance)
    files = {p: p.read_bytes() for p in sorted(runs.rglob("results.json"))}
    assert len(files) == 2
    return conf, runs, files


def test_an_edited_title_redraws_the_finished_runs_without_running_them(finished, tmp_path):
    conf, runs, files = finished
    _experiment(conf, "second title", unused=0.9)  # the title and an entry no run read
    for variance in ("embedded", "learned"):
        kept = _run(conf, runs, variance, "skip_existing=true")
        assert kept["table"]["title"] == "first title"  # the stored results, returned as is
    assert {p: p.read_bytes() for p in sorted(runs.rglob("results.json"))} == files
    md = write_tables(runs, tmp_path / "tables", configs=conf)["tiny_layout"].read_text()
    assert md.startswith("## second title\n")
    assert "first title" not in md and "| embedded " in md and "| learned " in md


def test_an_edited_entry_a_run_read_is_another_configuration(finished):
    conf, runs, _ = finished
    (conf / "experiment" / "tiny_layout.yaml").write_text(
        (conf / "experiment" / "tiny_layout.yaml").read_text().replace("embedded: 0.01",
                                                                       "embedded: 0.05"))
    with pytest.raises(ConfigMismatchError, match=r"trainer\.optimizer\.lr: 0\.01 \(stored\) "
                                                  r"→ 0\.05 \(requested\)"):
        _run(conf, runs, "embedded", "skip_existing=true")


def test_an_experiment_without_a_config_keeps_the_layout_its_runs_stored(finished, tmp_path,
                                                                         caplog):
    _, runs, _ = finished
    with caplog.at_level(logging.INFO, logger="uqbench"):
        md = write_tables(runs, tmp_path / "tables")["tiny_layout"].read_text()
    assert md.startswith("## first title\n")
    assert any("tiny_layout: no conf/experiment/tiny_layout.yaml" in r.getMessage()
               for r in caplog.records)


def test_a_packaged_experiment_is_laid_out_by_its_config_not_by_a_stale_stored_spec(tmp_path):
    """A run of p2_width_sweep that stored an older title is drawn with the config's."""
    import json

    from uqbench.report.table_layout import configured

    spec = configured("p2_width_sweep")
    assert spec is not None and spec["title"]
    run_ = {"experiment": "p2_width_sweep", "seed": 0, "metrics": {"test/nll": 1.0},
            "table": spec | {"title": "an older title"}}
    path = tmp_path / "runs" / "p2_width_sweep" / "seed0" / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run_))
    md = write_tables(tmp_path / "runs", tmp_path / "tables")["p2_width_sweep"].read_text()
    assert md.startswith(f"## {spec['title']}\n") and "an older title" not in md
