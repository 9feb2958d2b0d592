"""The runner's jobs, one module each, and the one table that says which runs for ``job=``.

- ``train`` (:mod:`~uqbench.runner.jobs.train`): train and score one configuration in its run
  folder; with ``stack_seeds`` several seeds side by side (:mod:`~uqbench.runner.jobs.stacked`).
- ``params`` (:mod:`~uqbench.runner.jobs.params`): count a method's parameters, no data.
- ``eval`` (:mod:`~uqbench.runner.jobs.score`): score a finished run again, on other data or
  with other scoring options, into a folder of its own.

Beside them, commands of their own: ``uqbench-combine`` (:mod:`~uqbench.runner.jobs.combine`,
members trained as separate jobs scored as one ensemble) and ``uqbench-pretrain``
(:mod:`~uqbench.runner.jobs.pretrain`, the digits backbones). Every job runs on the engine
(:mod:`uqbench.runner.engine`); what a job is, is read here only (:func:`job_of`, the run
spec's ``job``).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from omegaconf import DictConfig

# job= → the function that runs it ("module:function" under uqbench.runner.jobs, imported when
# the job runs, so that the table needs none of the jobs' imports)
JOBS: dict[str, str] = {"train": "train:train_job", "params": "params:params_run",
                        "eval": "score:eval_job"}


def job_of(cfg: DictConfig | dict[str, Any]) -> str:
    """The config's job (``train`` when it names none), or an error naming the valid ones."""
    job = str(cfg.get("job") or "train")
    if job not in JOBS:
        raise ValueError(f"job '{job}' is not one of: {', '.join(JOBS)}")
    return job


def runner(job: str) -> Callable[[Any], Any]:
    """The function that runs ``job`` (a name of :data:`JOBS`), given the job's
    :class:`~uqbench.runner.spec.RunSpec`."""
    module, name = JOBS[job].split(":")
    function: Callable[[Any], Any] = getattr(
        import_module(f"uqbench.runner.jobs.{module}"), name)
    return function
