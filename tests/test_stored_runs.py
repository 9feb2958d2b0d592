"""Run folders written before the run spec existed are recognised and reused as they are.

``tests/fixtures/stored_runs/`` holds the config.yaml and results.json of runs the runner wrote
before its config became a :class:`~uqbench.runner.spec.RunSpec` (a regression run, a
classification run with its checkpoint and a scoring of it, a parameter count, two stacked
seeds), with a relative runs folder. The same commands today, with ``skip_existing=true``,
must find each of them and leave every byte as it was: a run that is not recognised trains
into a new folder or is refused, and either fails here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import run_cli

STORED = Path(__file__).parent / "fixtures" / "stored_runs"
SINGLE = "default/fake_images/single/tiny_vit/trainer.epochs=1,trainer.optimizer.lr=0.01/seed0"
BNN = "default/polynomial/bnn_{}/mlp_w16/trainer.epochs=2/seed{}"
COMMANDS = {
    "a regression run": (["trainer.epochs=2"], [BNN.format("embedded", 0)]),
    "a classification run": (["backbone=tiny_vit", "dataset=fake_images", "method=single",
                              "trainer.epochs=1", "trainer.optimizer.lr=0.01"], [SINGLE]),
    "a parameter count": (["experiment=p1_overhead", "backbone=tiny_vit", "method=sve"],
                          ["p1_overhead/none/sve_m4/tiny_vit/seed0"]),
    "stacked seeds": (["stack_seeds=[0,1]", "trainer.epochs=2", "method.variance=learned"],
                      [BNN.format("learned", 0), BNN.format("learned", 1)]),
    "a scoring": (["job=eval", "eval_run='{runs}/" + SINGLE + "'"], [SINGLE + "/eval/fake_images"]),
}


def _files(root: Path) -> dict[str, bytes]:
    """Every file of the runs (a sweep's own record, its log and lock files aside)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.endswith((".lock", ".log"))
            and ".sweeps" not in p.relative_to(root).parts}


@pytest.mark.parametrize("what", list(COMMANDS))
def test_a_run_stored_before_the_spec_is_reused_untouched(tmp_path, what):
    runs = tmp_path / "runs"
    shutil.copytree(STORED, runs)
    before = _files(runs)
    args, folders = COMMANDS[what]
    proc = run_cli("skip_existing=true", f"paths.runs_dir={runs}", "torch_threads=1",
                   "plot=false", "trainer.progress=false",
                   *(a.format(runs=runs) for a in args), check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for folder in folders:
        assert (runs / folder / "results.json").is_file()
    assert _files(runs) == before  # nothing trained, scored or rewritten: every run reused
