"""What makes two runs the same run, defined once.

A run's identity is what it resolved and used: its resolved config, less the keys that say where
and how it is kept or shown (:data:`RECORD_KEYS`), the engine's layout (:data:`ENGINE_LAYOUT`:
the same computation on other hardware), the options its method declares speed-only
(``speed_options`` on the method's class, e.g. the BNN's ``fused`` and ``compile``) and the
lookup tables (:data:`LOOKUP`). What a run scores is identity too: ``eval_splits: [val]`` (a
selection run, no test number) is another run than ``eval_splits: null``, which older runs
stored without the key count as. Two things read it:

- the run folder's path (``uqbench.configs.identity_overrides``): an override that changes the
  identity and that the path does not already show (:data:`SHOWN_IN_PATH`) names a subfolder;
- reuse of a stored run (``uqbench.records.runfolder.reuse``): :func:`differences` between the
  stored and the requested resolved configs must be empty.

**Lookup tables.** An experiment's tables that interpolations read (a learning rate per backbone
and method) live under the reserved top-level key ``lookup:``, which is never identity: the
values a run read from it are already in its resolved config (``trainer.optimizer.lr``), so
editing one entry leaves every run that did not read it reusable. :data:`FORMER_LOOKUPS` are
tables runs stored at the top level before the rule.

Imports nothing of uqbench: a method's speed-only options are found from the dotted
``method._target_`` at run time.
"""

from __future__ import annotations

from typing import Any

# Top-level keys that say where and how a run is kept, shown or scored, never what it computes.
RECORD_KEYS = frozenset({
    "paths", "skip_existing", "overwrite", "save_predictions", "plot", "device", "torch_threads",
    "logger", "run_dir", "run_subdir", "run_name", "hydra", "table", "resume", "eval_run",
    "objective", "stack_seeds"})
# The reserved top-level key of an experiment's lookup tables (see the module's docstring).
LOOKUP = "lookup"
# Lookup tables that runs stored at the top level before ``lookup:`` existed.
FORMER_LOOKUPS = frozenset({"digits_recipe", "digits_rank_recipe"})
# Overrides the run folder's path already shows: <experiment>/<dataset>/<method>/<backbone>/seed.
SHOWN_IN_PATH = frozenset({"seed", "run_name", "experiment", "experiment_name", "method",
                           "backbone", "dataset"})
# The engine's layout (processes, micro-batches, checkpoints) lays the same computation out on
# other hardware: a run resumed on another GPU count is the same run.
ENGINE_LAYOUT = ("strategy", "devices", "num_nodes", "accumulate", "activation_checkpointing",
                 "checkpoint_every", "keep_checkpoint", "progress", "log_every")
# Keys added to the config since runs were first stored, with the value the older runs used.
# rank: null is SVE as it always was; MC-Dropout's earlier runs drew nn.Dropout's masks (the
# fast masks draw other numbers for a seed, so those runs are another configuration);
# select_metric: nll is the lowest validation loss that select=best always kept. The conformal
# options only add metrics (split-conformal sets fitted on val after training): a run stored
# before they existed is the same run without those metrics (`job=eval` adds them). The BNN's
# covariance: diagonal is the moment propagation its runs always used, and the mixture's sizes
# only act with covariance: mixture, which a training run refuses. A value may depend on the
# rest of the stored config (a function of its dotted keys): the noise term's split
# (mixture_link_nodes) acts only in a learned-variance mixture scoring, and such a scoring
# stored before the key closed a₂ as one Gaussian per component, which is 0; elsewhere the key
# is inert and counts as its default. data_order: shared is how the Deep Ensemble's and
# LoRA-Ensemble's members always trained (one mini-batch for all) before the key existed. The
# digits benchmark's first protocol is what its runs stored before ood_classes and kind_targets
# existed used: OOD a held-out third of 0–4 (null), the kind pool learnt by its labels.
def _link_nodes_before_the_split(flat: dict[str, Any]) -> int:
    mixed = flat.get("method.covariance") == "mixture" and flat.get("method.variance") == "learned"
    return 0 if mixed else 8


ADDED_KEYS: dict[str, Any] = {"trainer.precision": "32", "method.rank": None,
                              "method.masks": "torch", "trainer.select_metric": "nll",
                              "task.conformal_alpha": 0.1, "task.conformal": ["thr", "aps"],
                              "task.conformal_score": "normalized",
                              "method.covariance": "diagonal", "method.mixture_modes": 2,
                              "method.mixture_nodes": 8,
                              "method.mixture_link_nodes": _link_nodes_before_the_split,
                              "method.data_order": "shared", "dataset.ood_classes": None,
                              "backbone.ood_classes": None, "backbone.kind_targets": "labels"}


def added_value(flat: dict[str, Any], key: str) -> Any:
    """The value a config that lacks ``key`` (dotted; ``flat``: its other keys) ran with:
    :data:`ADDED_KEYS`' value, or null for a key that is not there."""
    value = ADDED_KEYS.get(key)
    return value(flat) if callable(value) else value


def speed_options(config: dict[str, Any]) -> tuple[str, ...]:
    """The options the config's method class declares speed-only (its ``speed_options``),
    () when the config names no method class or the class cannot be imported (a run stored by
    a version whose class is gone keeps its options as identity)."""
    return _declared(config, "speed_options")


def scoring_options(config: dict[str, Any]) -> tuple[str, ...]:
    """The options the config's method class lets a scoring job (``job=eval``) change: how a
    trained model predicts, not what it learned (its ``scoring_options``, e.g. the BNN's
    ``covariance``); () as :func:`speed_options`."""
    return _declared(config, "scoring_options")


def _declared(config: dict[str, Any], attribute: str) -> tuple[str, ...]:
    """A tuple attribute of the config's method class, () without an importable class."""
    method = config.get("method")
    target = method.get("_target_") if isinstance(method, dict) else None
    if not isinstance(target, str):
        return ()
    from hydra.utils import get_class

    try:
        cls = get_class(target)
    except (ImportError, ValueError):
        return ()
    return tuple(getattr(cls, attribute, ()))


def _kept_apart(prefix: str, key: str, speed: tuple[str, ...]) -> bool:
    """Whether ``<prefix><key>`` is no part of a run's identity."""
    if str(key).startswith("_"):
        return True  # Hydra's keys (_target_, _partial_)
    if not prefix:
        return key in RECORD_KEYS or key == LOOKUP or key in FORMER_LOOKUPS
    return ((prefix == "trainer." and key in ENGINE_LAYOUT)
            or (prefix == "method." and key in speed))


def identity(config: dict[str, Any], speed: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The resolved config as dotted keys, without what is no part of a run's identity;
    ``speed``: the method's speed-only options (default: those its class declares)."""
    speed = speed_options(config) if speed is None else speed
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if not _kept_apart(prefix, k, speed):
                    walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = node

    walk(config, "")
    return flat


def differences(stored: dict[str, Any], requested: dict[str, Any],
                limit: int = 8) -> list[str]:
    """``key: stored → requested`` for each identity key that differs (at most ``limit``)."""
    speed = tuple(sorted({*speed_options(stored), *speed_options(requested)}))
    a, b = identity(stored, speed), identity(requested, speed)

    # a key one side lacks counts as null, or as the value that reproduces the runs stored
    # before the key existed: a newer config may add options
    def value(flat: dict[str, Any], key: str) -> Any:
        return flat[key] if key in flat else added_value(flat, key)

    keys = sorted(k for k in set(a) | set(b) if value(a, k) != value(b, k))
    lines = [f"{k}: {a.get(k, '<absent>')!r} (stored) → {b.get(k, '<absent>')!r} (requested)"
             for k in keys[:limit]]
    return lines + ([f"… and {len(keys) - limit} more"] if len(keys) > limit else [])


def kept_apart_override(key: str, speed: tuple[str, ...]) -> bool:
    """Whether a command-line override of dotted ``key`` leaves the run's identity alone or is
    already shown by the run folder's path; ``speed``: the composed method's speed-only
    options. A lookup override is kept: it may change what a run reads."""
    head, _, rest = key.partition(".")
    if not rest:
        return key in RECORD_KEYS or key in SHOWN_IN_PATH
    return head in RECORD_KEYS or _kept_apart(f"{head}.", rest.split(".")[0], speed)
