"""The engine: what a job runs on, whatever the job. The training loop and model selection
(:mod:`~uqbench.runner.engine.loop`), devices, precision and Lightning Fabric
(:mod:`~uqbench.runner.engine.fabric`), FSDP wrapping (:mod:`~uqbench.runner.engine.fsdp`),
per-member gradients (:mod:`~uqbench.runner.engine.gradients`), checkpoints
(:mod:`~uqbench.runner.engine.checkpoints`), the memory budget
(:mod:`~uqbench.runner.engine.memory`) and prediction and scoring of the evaluation splits
(:mod:`~uqbench.runner.engine.evaluation`). Nothing here reads the Hydra config's job or writes
a run folder: the jobs (:mod:`uqbench.runner.jobs`) do."""
