"""Scoring a finished run (``job=eval``): its checkpoint on a dataset's splits, no training.

The run is ``eval_run`` (or the folder this command names). Everything but the data comes from
the run's stored config; the dataset (and its task) come from the command when it names one
(``dataset=cifar100_c``), else from the run; the splits scored are the command's
``eval_splits`` (null: every split of that dataset). The results land in
``<run>/eval/<dataset>/`` (``<dataset>,eval_splits=[…]`` when the splits are restricted:
another scoring, another folder; results.json, predictions/), published all at once under the
scored run's lock; the run's own files are never touched. A Deep Ensemble combined from member
jobs is scored from its members' checkpoints, their predictions joined in member order.
results.json holds the scored run's settings (with the scoring options applied) and parameter
counts, so an experiment's table can put its scorings beside its runs (``table.scorings``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from uqbench.identity import scoring_options
from uqbench.records.loggers import log_results, run_labels
from uqbench.records.results import write_stage
from uqbench.records.runfolder import (
    ConfigMismatchError,
    RunExistsError,
    RunFolder,
    finished,
    stored_differences,
)
from uqbench.runner import outcomes
from uqbench.runner.engine import checkpoints
from uqbench.runner.engine.evaluation import Splits, predict_splits, score
from uqbench.runner.engine.fabric import resolve_device
from uqbench.runner.outcomes import RunFailed
from uqbench.runner.parts import build_parts, environment, method_diagnostics, seed_and_threads
from uqbench.runner.spec import RunSpec, value_at
from uqbench.tasks.classification import join_members

log = logging.getLogger("uqbench")


def eval_job(spec: RunSpec) -> dict[str, Any]:
    """``job=eval``: score a finished run on a dataset; return the results (also on disk)."""
    run_dir = spec.scored_folder
    stored, scored_run, sources = _sources(run_dir)
    keys = _command_keys()
    scoring = _scoring_overrides(keys, stored)
    _refuse_unapplied(spec, stored, [k for k in keys or [] if k not in scoring])
    chosen, changed = _dataset_overrides(keys)
    changed += scoring  # put on the run's config, and named in the eval folder
    task_keys = [] if keys is None else sorted(k[5:] for k in keys if k.startswith("task."))
    specs = {s: _eval_spec(spec, c, chosen, changed, task_keys) for s, c in sources.items()}
    run_spec = _eval_spec(spec, stored, chosen, changed, task_keys)
    device, fallback = resolve_device(spec.device)
    out = _folder(spec, run_dir, run_spec, changed)
    run_config = dict(run_spec.config)
    with RunFolder(out, lock_on=run_dir) as folder:
        if (kept := _kept(spec, out, run_config)) is not None:
            return kept
        header = {"job": "eval", "of_run": str(run_dir), "experiment": run_spec.experiment,
                  "run": run_spec.run_subdir, "dataset": run_spec.dataset.name,
                  "method": run_spec.method.name, "backbone": run_spec.backbone.name,
                  "seed": run_spec.seed, "scored_from": [str(s) for s in sources],
                  # the method's scoring options the command changed (method.covariance=full)
                  "scored_with": {k: spec.at(k) for k in scoring},
                  "eval_splits": run_config.get("eval_splits")}
        try:
            results = _score_run(spec, folder, specs, device, fallback, header, scored_run,
                                 run_spec, scoring)
        except (Exception, SystemExit) as err:  # the work had started: a failed scoring
            record = header | {"settings": scored_run.get("settings"), "failed": True,
                               "table": run_config.get("table")}
            raise RunFailed(out, err, record) from err
    _track(spec, run_spec, results, out)
    return results


def _score_run(spec: RunSpec, folder: RunFolder, specs: dict[Path, RunSpec],
               device: torch.device, fallback: str | None, header: dict[str, Any],
               scored_run: dict[str, Any], run_spec: RunSpec, scoring: list[str]
               ) -> dict[str, Any]:
    """Predict, score and publish one scoring; its results."""
    start = time.perf_counter()
    predictions, data, splits, task, diagnostics = _predict(specs, device)
    metrics, calibration = score(predictions, task, splits.eval, splits.ood)
    metrics.update(diagnostics)
    results = {**header,
               "settings": _settings(scored_run, run_spec, data, scoring),
               "params": scored_run.get("params"),  # the scored model's, unchanged
               "metrics": metrics, "calibration": calibration,
               "time": {"eval_s": time.perf_counter() - start},
               "environment": environment(),
               "device": str(device), "device_note": fallback,
               "recipe": scored_run.get("recipe") or {}}  # the scored run's choices
    with folder.staging() as stage:
        write_stage(stage, dict(run_spec.config), results,
                    predictions if spec.save_predictions else {})
        folder.publish(stage)
    return results


def _folder(spec: RunSpec, run_dir: Path, run_spec: RunSpec, changed: list[str]) -> Path:
    """``<run>/eval/<dataset>[,<key>=<value>…][,eval_splits=[…]]``: the scoring's folder, named
    by the dataset scored, the dataset keys and scoring options the command changed, and the
    splits when restricted."""
    return run_dir / "eval" / ",".join([run_spec.dataset.name, *(
        f"{k}={spec.at(k)}" for k in changed), *_restricted(spec)])


def eval_folder(spec: RunSpec) -> Path:
    """The folder a ``job=eval`` command writes (:func:`_folder`), from its config and the
    scored run's stored one, without building anything; Hydra puts the job's log there (the
    ``uq.log_dir`` resolver), so a scoring keeps its log beside its results. Raises what
    :func:`eval_job` would for a run that cannot be scored (no finished run there)."""
    run_dir = spec.scored_folder
    stored, _ = finished(run_dir)
    keys = _command_keys()
    chosen, changed = _dataset_overrides(keys)
    changed += _scoring_overrides(keys, stored)
    return _folder(spec, run_dir, _eval_spec(spec, stored, chosen, changed), changed)


def _settings(scored_run: dict[str, Any], run_spec: RunSpec, data: Any,
              scoring: list[str]) -> dict[str, Any]:
    """The scored run's settings as this job scored with them: its own method, backbone and
    trainer settings, with the scoring options the command changed put in (``method.covariance:
    full``), and the data and task scored. A table that takes scorings (``table.scorings``)
    groups them by these like training runs."""
    settings = {k: v for k, v in (scored_run.get("settings") or {}).items()
                if isinstance(v, dict)}
    for key in scoring:  # method.<option>: a scoring option of the run's method
        group, _, option = key.partition(".")
        settings[group] = dict(settings.get(group) or {}) | {
            option: run_spec.at(key)}
    return settings | {"dataset": run_spec.dataset.settings | data.settings(),
                       "task": run_spec.task.settings}


def _sources(run_dir: Path
             ) -> tuple[dict[str, Any], dict[str, Any], dict[Path, dict[str, Any]]]:
    """The scored run's stored config and results, and the folders whose checkpoints make up
    its model (the run's own, or its members') with their stored configs."""
    stored, scored = finished(run_dir, ": job=eval needs a finished run (eval_run=<run folder> "
                                       "names the run to score)")
    members = [Path(str(stored["paths"]["runs_dir"])) / m
               for m in scored.get("combined_from") or []]
    sources = {m: finished(m)[0] for m in members} if members else {run_dir: stored}
    for source in sources:
        if not (source / checkpoints.FINAL).is_file():
            raise checkpoints.CheckpointError(
                f"{source} has no {checkpoints.FINAL}: it was trained without keeping one "
                f"(trainer.keep_checkpoint=none, or before runs kept checkpoints). Train it "
                f"again (overwrite=true) to score it on other data")
    return stored, scored, sources


def _restricted(spec: RunSpec) -> list[str]:
    """The eval folder's name part for restricted splits (``eval_splits=[val]``), or none."""
    splits = spec.eval_splits
    return [] if splits is None else [
        "eval_splits=[" + ",".join(str(s).replace("/", "_") for s in splits) + "]"]


def _kept(spec: RunSpec, out: Path, requested: dict[str, Any]) -> dict[str, Any] | None:
    """The stored results where skip_existing keeps them; None where this job scores.

    skip_existing (and a multirun, always) keeps only a scoring of the same configuration:
    one whose stored config differs from ``requested`` (a scoring option whose default
    changed since, a scored run trained again) is refused with the differences, before any
    work; overwrite=true scores again and replaces it. The folder's name shows only the
    options the command named, so this is what keeps a stale scoring from passing for
    today's."""
    if not (out / "results.json").is_file() or spec.overwrite:
        return None
    if diff := stored_differences(out, requested):
        raise ConfigMismatchError(
            f"{out} holds a scoring of another configuration:\n  " + "\n  ".join(diff)
            + "\nskip_existing=true keeps only the same configuration's: pass overwrite=true "
              "to score it again (the stored scoring is replaced)")
    if spec.skip_existing or outcomes.sweep_dir() is not None:  # a multirun reuses it
        kept: dict[str, Any] = json.loads((out / "results.json").read_text())
        return kept
    raise RunExistsError(f"{out}/results.json already exists: overwrite=true replaces "
                         f"it, skip_existing=true keeps it")


def _predict(specs: dict[Path, RunSpec], device: torch.device
             ) -> tuple[dict[str, Any], Any, Splits, Any, dict[str, float]]:
    """Predictions of the splits scored (members' joined in member order), the data, those
    splits and the task that scores them, and the method's own diagnostics (a model from one
    checkpoint only)."""
    parts = []
    for source, source_spec in specs.items():
        state = checkpoints.load(source / checkpoints.FINAL)
        seed_and_threads(source_spec)
        method, data, task, _, splits = build_parts(source_spec, device)
        method.load_trainable_state({k: v.to(device) for k, v in state["trainable"].items()})
        method.fit_posthoc(data, device)  # e.g. a Laplace posterior, refitted on these weights
        parts.append(predict_splits(method, data, task, device, splits))
    # a model scored from one checkpoint can check itself; members combined cannot
    diagnostics = (method_diagnostics(method, data, device, scored=splits.eval)
                   if len(parts) == 1 else {})
    predictions = parts[0] if len(parts) == 1 else {
        split: (join_members([p[split] for p in parts]) if "member_probs" in parts[0][split]
                else parts[0][split]) for split in parts[0]}
    return predictions, data, splits, task, diagnostics


def _track(spec: RunSpec, run_spec: RunSpec, results: dict[str, Any], out: Path) -> None:
    """Hand the results to the tracker, in the folder of the scored run's experiment."""
    logger = spec.derive({"experiment_name": run_spec.experiment}).logger.build()
    choices = {g: str(results[g]) for g in ("method", "backbone", "dataset")}
    labels = run_labels(dict(run_spec.config), choices, "eval",
                        f"{run_spec.run_subdir}/eval/{out.name}", setting=run_spec.run_subdir)
    logger.start(out, labels, dict(run_spec.config))
    log_results(logger, results, out, [])


def _eval_spec(spec: RunSpec, stored: dict, chosen: bool, changed: list[str],
               task_keys: Sequence[str] = ()) -> RunSpec:
    """The spec of a stored run's config with the command's dataset (or dataset keys), device
    and output choices put in; ``task_keys``: the ``task.<key>`` names the command set."""
    run_cfg = OmegaConf.create(stored)
    if chosen:  # another dataset: its config and task from the command
        task: Any = spec.task.node
        if stored.get("task", {}).get("_target_") == spec.task.target:
            # the same kind of task: the run's own scoring options (aggregation, ECE bins)
            # stay, unless the command sets them (task.<key>=…)
            task = OmegaConf.merge(stored["task"], {k: spec.task.fields[k] for k in task_keys})
        run_cfg.dataset, run_cfg.task = spec.dataset.node, task
    for key in changed:  # dataset.<key>=<value>: on top of the run's dataset
        OmegaConf.update(run_cfg, key, spec.at(key), force_add=True)
    for key in ("device", "save_predictions", "eval_splits"):
        run_cfg[key] = spec.config.get(key)
    if spec.torch_threads is not None:  # else the run's own: the same float reductions
        run_cfg.torch_threads = spec.torch_threads
    return RunSpec.of(run_cfg, check=False)


def _command_keys() -> list[str] | None:
    """The keys the command line set (``a.b=…`` → ``a.b``); None without Hydra's command line."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task]


#: config groups a scoring job takes from the scored run, whatever the command says
FROM_RUN = ("method", "backbone", "trainer")


def _scoring_overrides(keys: list[str] | None, stored: dict[str, Any]) -> list[str]:
    """The command's ``method.<option>`` keys that the run's method lets a scoring job change
    (its class's ``scoring_options``, e.g. the BNN's ``method.covariance``), sorted."""
    allowed = scoring_options(stored)
    return sorted(k for k in keys or [] if k.startswith("method.") and k[7:] in allowed)


def _refuse_unapplied(spec: RunSpec, stored: dict[str, Any], keys: list[str]) -> None:
    """A scoring job scores the run as it was trained: a command's method, backbone or trainer
    setting that differs from the run's (``method.rank=4`` on a rank-8 run) would be silently
    ignored, so it is refused; the method's scoring options are not among ``keys``. Settings
    equal to the run's pass (a sweep ``job=train,eval`` gives both jobs the same overrides)."""
    differ = []
    for key in keys:
        if key.split(".")[0] not in FROM_RUN:
            continue
        path = key if "." in key else f"{key}.name"  # method=sve: the option chosen, by name
        asked = spec.at(path)
        ran = value_at(stored, path)
        if asked != ran:
            differ.append(f"{path}={asked} (the run has {ran})")
    if differ:
        options = ", ".join(f"method.{o}" for o in scoring_options(stored)) or "none"
        raise ValueError(f"job=eval scores the run as it was trained, with its own method, "
                         f"backbone and trainer; the command sets {'; '.join(differ)}. "
                         f"A scoring job takes dataset=…, dataset.<key>, task.<key>, "
                         f"eval_splits, device, output options and the method's scoring "
                         f"options ({options}); train another run for another setting")


def _dataset_overrides(keys: list[str] | None) -> tuple[bool, list[str]]:
    """Whether the command chose a dataset (``dataset=…``), and the ``dataset.<key>`` values
    it set. A config composed without Hydra's command line counts as choosing its dataset."""
    if keys is None:
        return True, []
    return "dataset" in keys, sorted(k for k in keys if k.startswith("dataset."))


def _log_dir(default: str, *, _root_: DictConfig) -> str:
    """Hydra's job folder (where it writes the job's log): ``default`` (the run folder) for a
    training job; for a scoring job (``job=eval``) the scoring's own folder,
    ``<run>/eval/<name>/``, so that its log lands beside its results and not in the run folder
    the command's other settings name (the default config's, for ``job=eval eval_run=…``).
    Where that folder cannot be named (no finished run at ``eval_run``), ``default``: the job
    then refuses with its own message, and the log-only folder goes with it."""
    if _root_.get("job") != "eval":
        return default
    try:
        return str(eval_folder(RunSpec.of(_root_, check=False)).absolute())
    except Exception:  # noqa: BLE001 - raised again, with the job's own message, by the job
        return default


# Registered on import: the CLI (and every launcher's job process) imports this module before
# Hydra resolves its job folder.
OmegaConf.register_new_resolver("uq.log_dir", _log_dir, replace=True)
