"""Deep Ensemble members trained as separate jobs → the ensemble's run (`uqbench-combine`).

A 7B Deep Ensemble does not fit one GPU: each member is its own job (``method.member=k``, one
GPU or node each, see ``uqbench/methods/deep_ensemble.py``), and this command combines the
member runs afterwards::

    uqbench-combine 'runs/…/de_m4/llama2_7b/method.member=*/seed0'

It checks that the member runs are one ensemble (stored configs identical except
``method.member``, members 0 … M−1 each present once, results and predictions of every split
saved), stacks the member predictions in member order (member_probs (M, N, C)), scores them
with the task of the stored config (``uqbench.runner.engine.evaluation.score``: the temperature is
refitted on the combined validation predictions) and writes a complete run folder, by default
the one the one-process Deep Ensemble of the same config gets (the ``method.member=k`` level
removed), so that tables read it as that row, through the runner's ``RunFolder``
(``uqbench.records.runfolder``): its lock, leftovers mended, another configuration refused,
results kept unless ``--overwrite`` (returned with ``--skip-existing``), published at once.

results.json is the runner's, with ``combined_from`` (the member runs, relative to the runs
folder like ``run``), ``params`` of the whole ensemble, ``time.train_s`` summed over the
members, ``cost`` summed (FLOPs) or the largest job's (memory), and ``train.selected_epoch``
per member when the members chose different epochs (``trainer.select=best``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from uqbench.configs import build
from uqbench.errors import user_errors
from uqbench.identity import identity
from uqbench.records.loggers import log_results, run_labels
from uqbench.records.results import write_stage
from uqbench.records.runfolder import RunFolder, RunLock, finished
from uqbench.runner.engine.evaluation import score
from uqbench.tasks.classification import join_members

log = logging.getLogger("uqbench")
MEMBER_KEY = "method.member"
FLAGS = ("--overwrite", "--skip-existing", "--out <folder>")  # as RunFolder.reuse names them


@dataclass
class Member:
    """One member job's finished run folder."""

    folder: Path
    config: dict[str, Any]
    results: dict[str, Any]

    @property
    def index(self) -> int:
        return int(self.config["method"]["member"])


# --- reading and checking the members ---------------------------------------------------------

def expand(patterns: list[str]) -> list[Path]:
    """Run folders from paths or glob patterns (quoted, so that the shell leaves them to us)."""
    folders: list[Path] = []
    for pattern in patterns:
        if Path(pattern).exists() or not glob.has_magic(pattern):
            folders.append(Path(pattern))
            continue
        matched = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_dir())
        if not matched:
            raise FileNotFoundError(f"no run folder matches {pattern!r}")
        folders += matched
    return folders


def read_member(folder: Path) -> Member:
    """A finished member run, or an error saying what is missing."""
    config, results = finished(
        folder, ": that member job has not finished (or failed); rerun it")
    if not isinstance(config.get("method"), dict) or config["method"].get("member") is None:
        raise ValueError(f"{folder} is not a member job (method.member is not set there): "
                         f"combine the runs of method.member=0 … members-1")
    return Member(folder, config, results)


def _without_member(config: dict[str, Any]) -> dict[str, Any]:
    flat = identity(config)
    flat.pop(MEMBER_KEY, None)
    return flat


def check_one_ensemble(members: list[Member]) -> None:
    """Identical configs except method.member; members 0 … M−1 each present exactly once."""
    first = members[0]
    reference = _without_member(first.config)
    for m in members[1:]:
        own = _without_member(m.config)
        keys = sorted(k for k in set(reference) | set(own) if reference.get(k) != own.get(k))
        if keys:
            lines = [f"{k}: {reference.get(k, '<absent>')!r} in {first.folder}, "
                     f"{own.get(k, '<absent>')!r} in {m.folder}" for k in keys[:8]]
            raise ValueError("these runs are not members of one ensemble; their configs differ "
                             "in more than method.member:\n  " + "\n  ".join(lines))
    M = int(first.config["method"]["members"])
    given: dict[int, list[Path]] = {}
    for m in members:
        given.setdefault(m.index, []).append(m.folder)
    twice = {k: v for k, v in given.items() if len(v) > 1}
    if twice:
        lines = [f"member {k}: {', '.join(map(str, v))}" for k, v in sorted(twice.items())]
        raise ValueError("a member is given more than once; pass each member's folder once:\n  "
                         + "\n  ".join(lines))
    missing = sorted(set(range(M)) - set(given))
    if missing:
        rerun = [o for o in first.results.get("overrides", [])
                 if o.split("=", 1)[0].lstrip("+~") != MEMBER_KEY]
        raise FileNotFoundError(
            f"member{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of the "
            f"{M}-member ensemble {'are' if len(missing) > 1 else 'is'} missing (given: "
            f"{', '.join(map(str, sorted(given)))}); run "
            f"{'them' if len(missing) > 1 else 'it'}: uqbench {' '.join(rerun)} "
            f"method.member={','.join(map(str, missing))}{' -m' if len(missing) > 1 else ''}")


def splits_of(member: Member) -> tuple[list[str], list[str], list[str]]:
    """(eval splits, OOD splits, every split with predictions) as the runner scored them: the
    dataset's (built, not set up) that ``eval_splits`` kept, and val where the member has it."""
    data = build(copy.deepcopy(member.config["dataset"]))
    val = ["val"] if any(k.startswith("val/") for k in member.results.get("metrics", {})) else []
    kept = member.config.get("eval_splits")
    eval_splits, ood_splits = ([s for s in splits if kept is None or s in kept]
                               for splits in (data.eval_splits, data.ood_splits))
    return eval_splits, ood_splits, [*eval_splits, *ood_splits, *val]


def load_predictions(member: Member, splits: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """predictions/<split>.npz of every split, classification only."""
    folder = member.folder / "predictions"
    if not member.config.get("save_predictions", True) and not folder.is_dir():
        raise FileNotFoundError(
            f"{member.folder} was run with save_predictions=false, and combining needs every "
            f"member's predictions: rerun that member with save_predictions=true overwrite=true")
    out = {}
    for split in splits:
        path = folder / f"{split}.npz"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: every member needs the predictions of "
                                    f"every split ({', '.join(splits)}); rerun that member")
        with np.load(path) as arrays:
            out[split] = {k: arrays[k] for k in arrays.files}
        if "member_probs" not in out[split]:
            raise ValueError(f"{path} holds no member_probs: only classification ensembles "
                             f"are combined (it holds {', '.join(out[split])})")
    return out


def stack(members: list[Member], per_member: list[dict[str, dict[str, np.ndarray]]]
          ) -> dict[str, dict[str, np.ndarray]]:
    """The members' predictions as one ensemble's (``join_members``), once their labels agree."""
    combined = {}
    for split in per_member[0]:
        labels = per_member[0][split]["labels"]
        for m, preds in zip(members[1:], per_member[1:], strict=True):
            if not np.array_equal(preds[split]["labels"], labels):
                raise ValueError(f"{m.folder}: the labels of split '{split}' differ from "
                                 f"{members[0].folder}'s: the members did not see the same data")
        combined[split] = join_members([p[split] for p in per_member])          # (M, N, C)
    return combined


# --- where the ensemble goes ------------------------------------------------------------------

def _drop_override(level: str, item: str) -> str | None:
    """The override level (sorted overrides joined by commas) without ``item``; '' when it was
    the only one; None when the level does not hold it."""
    if level == item:
        return ""
    if level.startswith(item + ","):
        return level[len(item) + 1:]
    if level.endswith("," + item):
        return level[:-len(item) - 1]
    if f",{item}," in level:
        return level.replace(f",{item},", ",", 1)
    return None


def ensemble_place(member: Member) -> tuple[Path, str] | None:
    """(folder, run) of the one-process ensemble of the member's config: the member's folder
    and run without its method.member=k level; None where the folder has no such level."""
    item = next((o.lstrip("+") for o in member.results.get("overrides", [])
                 if o.split("=", 1)[0].lstrip("+~") == MEMBER_KEY), None)
    run = str(member.results.get("run", ""))
    parts = Path(run).parts
    if item is None or len(parts) < 2 or member.folder.name != parts[-1]:
        return None
    item = item.replace("/", "_")
    level, run_level = _drop_override(member.folder.parent.name, item), parts[-2]
    if level is None or run_level != member.folder.parent.name:
        return None
    folder = member.folder.parent.parent / level / member.folder.name
    return folder, str(Path(*parts[:-2], level, parts[-1]))


# --- the combined run -------------------------------------------------------------------------

def ensemble_config(member: Member, run: str, folder: Path) -> dict[str, Any]:
    """The member's resolved config as the one-process ensemble stores it."""
    config = copy.deepcopy(member.config)
    config["method"]["member"] = None
    config["run_subdir"], config["run_dir"] = run, str(folder)
    return config


def ensemble_results(members: list[Member], config: dict[str, Any], run: str,
                     metrics: dict[str, float], calibration: dict | None, score_s: float
                     ) -> dict[str, Any]:
    """results.json of the ensemble, from its members' (the runner's keys, in its order)."""
    from hydra.utils import get_class

    first = members[0].results
    res = [m.results for m in members]
    method_cls = get_class(config["method"]["_target_"])
    if not hasattr(method_cls, "combine_param_counts"):
        raise ValueError(f"method {config['method']['_target_']} cannot combine member runs")
    settings = copy.deepcopy(first.get("settings", {}))
    if isinstance(settings.get("method"), dict):
        settings["method"]["member"] = None
    selected = [r.get("train", {}).get("selected_epoch") for r in res]
    devices = sorted({str(r.get("train", {}).get("device")) for r in res})
    flops = [r.get("cost", {}).get("forward_flops_per_example") for r in res]
    memory = [r.get("cost", {}).get("peak_memory_bytes") for r in res]
    overrides = [o for o in first.get("overrides", [])
                 if o.split("=", 1)[0].lstrip("+~") != MEMBER_KEY]
    return {
        **{k: first[k] for k in ("experiment", "dataset", "method", "backbone", "seed")},
        "run": run,
        "variant": first.get("variant"),
        "overrides": overrides,
        "settings": settings,
        "params": method_cls.combine_param_counts([r["params"] for r in res],
                                                  bool(config["method"].get("finetune", True))),
        "metrics": metrics,
        "calibration": calibration,
        "time": {"train_s": sum(r["time"]["train_s"] for r in res),
                 "eval_s": sum(r["time"]["eval_s"] for r in res) + score_s},
        "cost": {"forward_flops_per_example": (sum(flops) if None not in flops else None),
                 "peak_memory_bytes": max((m for m in memory if m is not None), default=None),
                 "peak_memory": f"the largest member job's: "
                                f"{first.get('cost', {}).get('peak_memory', '')}"},
        "environment": first.get("environment"),
        "train": {"epochs": first.get("train", {}).get("epochs"),
                  "selected_epoch": selected[0] if len(set(selected)) == 1 else selected,
                  "updated_weights": all(r.get("train", {}).get("updated_weights") for r in res),
                  "device": ", ".join(devices)},
        "table": first.get("table"),
        "combined_from": [r["run"] for r in res],
    }


def _member_lock(folder: Path) -> contextlib.AbstractContextManager[Any]:
    """The member folder's lock where a job made one; a folder copied without its lock file
    (from a cluster, say) is read without one, so that combining writes nothing beside it."""
    lock = RunLock(folder)
    return lock if lock.path.exists() else contextlib.nullcontext()


def combine(folders: list[Path], out: Path | None = None, overwrite: bool = False,
            skip_existing: bool = False) -> tuple[Path, dict[str, Any]]:
    """Combine member run folders into the ensemble's run folder; return (folder, results).
    Every check runs before anything is written; nothing of the members is changed."""
    if not folders:
        raise ValueError("give the member run folders (paths or a quoted glob)")
    members = sorted((read_member(f) for f in folders), key=lambda m: m.index)
    check_one_ensemble(members)
    places = {ensemble_place(m) for m in members}
    if out is None:
        place = places.pop() if len(places) == 1 else None
        if place is None:
            raise ValueError(
                f"cannot tell the ensemble's run folder from {members[0].folder}: it has no "
                f"method.member=k level (run_name?) or the members lie in different places; "
                f"give one with --out <folder>")
        out, run = place
    else:
        run = str(out)  # `run` names the folder the results are in
    if any(out.resolve() == m.folder.resolve() for m in members):
        raise ValueError(f"--out {out} is one of the member folders; give the ensemble its own")
    config = ensemble_config(members[0], run, out)
    # the members' tracker (logger=none: none), built now so that a bad setting fails first
    logger = build(copy.deepcopy(config["logger"])) if config.get("logger") else None
    with contextlib.ExitStack() as locks:
        for m in members:  # no member job rewrites its folder while it is read
            locks.enter_context(_member_lock(m.folder))
        eval_splits, ood_splits, splits = splits_of(members[0])
        predictions = stack(members, [load_predictions(m, splits) for m in members])
        # the first thing written: every check has passed
        folder = locks.enter_context(RunFolder(out))
        kept = folder.reuse(config, overwrite, skip_existing, flags=FLAGS)  # the runner's rule
        if kept is not None:
            log.info("skip: %s holds this ensemble's results (--skip-existing)", out)
            return out, kept
        start = time.perf_counter()
        metrics, calibration = score(predictions, build(copy.deepcopy(config["task"])),
                                     eval_splits, ood_splits)
        results = ensemble_results(members, config, run, metrics, calibration,
                                   time.perf_counter() - start)
        with folder.staging() as stage:
            write_stage(stage, config, results, predictions)
            folder.publish(stage)
    if logger is not None:  # the ensemble's record beside its members', as job type combine
        choices = {g: str(results[g]) for g in ("method", "backbone", "dataset")}
        logger.start(out, run_labels(config, choices, "combine", run), config)
        log_results(logger, results, out)
    return out, results


def main(argv: list[str] | None = None) -> None:
    """The ``uqbench-combine`` command."""
    parser = argparse.ArgumentParser(
        prog="uqbench-combine",
        description="Combine Deep Ensemble members trained as separate jobs (method.member=k) "
                    "into the ensemble's run folder, scored from the saved member predictions.")
    parser.add_argument("members", nargs="+",
                        help="the member run folders, or a quoted glob such as "
                             "'runs/…/method.member=*/seed0'")
    parser.add_argument("--out", type=Path, default=None,
                        help="the ensemble's run folder (default: the one-process Deep "
                             "Ensemble's, the member's folder without its method.member level)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the folder's results if it holds this configuration's")
    parser.add_argument("--skip-existing", action="store_true",
                        help="keep the folder's results if it holds this configuration's")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with user_errors(logged=False):  # the log goes to stderr already: one error line
        folder, results = combine(expand(args.members), args.out, args.overwrite,
                                  args.skip_existing)
    summary = {k: round(v, 4) for k, v in results["metrics"].items()
               if k.split("/")[0] in ("test", "ood") and k.count("/") == 1}
    print(f"{folder}: " + ", ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
