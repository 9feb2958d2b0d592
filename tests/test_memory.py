"""The training-memory estimate of job=params against hand computations on tiny_vit.

tiny_vit by hand: d = 16, 2 blocks, 2 heads, 16 px in 4-px patches → 16 patches + [CLS] = 17
tokens; 5552 parameters, of which 2 × 2160 sit in the wrapped qkv, proj, fc1, fc2 (weights and
biases), no buffers. SVE (M = 4, 2 classes) drops the wrapped weights and holds, per block,
U, V and s0 of each: qkv 48·16 + 16·16 + 16, proj 16·16 + 16·16 + 16, fc1 32·16 + 16·16 + 16,
fc2 16·16 + 32·16 + 16 = 3136 frozen values; it trains 4 × 2 × (4·16 singular values + 112
biases) + 4 heads × (2·16 + 2) = 1544 values. AdamW (trainer=p1): two states per trained value.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from uqbench.runner.engine.memory import Engine, block_activation_bytes, optimizer_states
from uqbench.runner.jobs.params import params_job
from uqbench.runner.spec import RunSpec

FROZEN = (5552 - 2 * 2160) + 2 * 3136    # values held frozen: 7504
TRAINED = 4 * 2 * (4 * 16 + 112) + 4 * (2 * 16 + 2)  # 1544
L, S, H, A, M, BATCH = 2, 17, 16, 2, 4, 16


def blocks(rows: int, value_bytes: int, recompute: bool = False) -> int:
    """Korthikanti et al. 2022: per block s·b·h·(34 + 5·a·s/h) bytes at 16 bit, 2·s·b·h with
    full recomputation; written out here for the tiny sizes."""
    per_block = 2 * S * rows * H if recompute else S * rows * H * 34 + 5 * A * S * S * rows
    return L * per_block * value_bytes // 2


@pytest.fixture(scope="module")
def memory():
    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        def job(*overrides: str, method: str = "sve") -> dict:
            mode = ["method.forward_mode=factorized"] if method == "sve" else []
            return params_job(RunSpec.of(compose("config", overrides=[
                "job=params", "dataset=none", "backbone=tiny_vit", f"method={method}",
                "trainer=p1", *mode, *overrides])))["memory"]

        yield job
    GlobalHydra.instance().clear()


# precision, strategy, checkpointing → bytes per frozen/trained value and per activation value
CASES = {
    "fp32 ddp": (["trainer.strategy=ddp"], 4, 4, 4, 1, False),
    "fp32 fsdp": (["trainer.strategy=fsdp"], 4, 4, 4, 4, False),
    "bf16-mixed ddp": (["trainer.strategy=ddp", "trainer.precision=bf16-mixed"], 4, 4, 2, 1,
                       False),
    "bf16-true ddp": (["trainer.strategy=ddp", "trainer.precision=bf16-true"], 2, 2, 2, 1,
                      False),
    "bf16-true fsdp": (["trainer.strategy=fsdp", "trainer.precision=bf16-true"], 2, 2, 2, 4,
                       False),
    "fp32 fsdp ckpt": (["trainer.strategy=fsdp", "trainer.activation_checkpointing=true"],
                       4, 4, 4, 4, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sve_on_tiny_vit_over_4_devices_matches_the_hand_count(memory, case):
    overrides, frozen_b, trained_b, act_b, shard, ckpt = CASES[case]
    got = memory("trainer.devices=4", *overrides)
    micro = BATCH // 4                                   # 16 over 4 devices, no accumulation
    rows = micro * M                                     # members in the batch
    # factorised SVE keeps x·V, (M, N, r) with N = micro · tokens rows per member, per layer
    wrappers = 0 if ckpt else 8 * M * micro * S * 16 * act_b
    expected = {
        "frozen_params": FROZEN * frozen_b // shard,
        "trained_params": TRAINED * trained_b // shard,
        "buffers": 0,
        "gradients": TRAINED * trained_b // shard,
        "optimizer": 2 * TRAINED * trained_b // shard,
        "activations_blocks": blocks(rows, act_b, ckpt),
        "activations_wrappers": wrappers,
    }
    expected["total"] = sum(expected.values())
    assert got["bytes"] == expected
    assert sum(v for k, v in got["bytes"].items() if k != "total") == got["bytes"]["total"]
    assert got["micro_batch"] == micro and got["rows"] == rows and got["tokens"] == S
    assert got["world_size"] == 4 and got["gb"]["total"] == round(expected["total"] / 1e9, 3)


def test_fp32_ddp_total_written_out(memory):
    """One case as a single number: 30016 + 6176 + 6176 + 12352 frozen/trained/gradient/
    optimiser bytes, 2·17·16·16·(34 + 5·2·17/16)·2 = 776832 block and 8·4·4·17·16·4 = 139264
    wrapper activation bytes."""
    assert memory("trainer.devices=4", "trainer.strategy=ddp")["bytes"]["total"] == 970_816


def test_batch_accumulation_nodes_and_layouts(memory):
    got = memory("trainer.devices=2", "trainer.num_nodes=2", "trainer.accumulate=2",
                 "+overhead.layouts={one: {devices: 1, num_nodes: 1, accumulate: 1}}")
    assert got["strategy"] == "ddp" and got["world_size"] == 4     # auto over 4 devices
    assert got["micro_batch"] == 2                                 # 16 / (2 · 2 · 2)
    one = got["layouts"]["one"]
    assert one["strategy"] == "single" and one["micro_batch"] == 16
    assert one["bytes"]["activations_blocks"] == blocks(16 * M, 4)


@pytest.mark.parametrize("optimizer,momentum,states", [("torch.optim.SGD", 0.9, 1),
                                                       ("torch.optim.SGD", 0.0, 0)])
def test_sgd_keeps_one_state_with_momentum_and_none_without(memory, optimizer, momentum,
                                                            states):
    got = memory(f"trainer.optimizer._target_={optimizer}",
                 f"+trainer.optimizer.momentum={momentum}")
    assert got["optimizer_states"] == states
    assert got["bytes"]["optimizer"] == states * TRAINED * 4


def test_only_heads_training_keeps_no_activations(memory):
    """A linear probe back-propagates into the heads only: nothing of the encoder is kept."""
    got = memory(method="deep_ensemble_lp")
    assert got["passes"] == 0 and got["bytes"]["activations_blocks"] == 0


def test_mc_dropout_trains_one_pass_per_example(memory):
    got = memory("method.samples=10", method="mc_dropout")
    assert got["passes"] == 1 and got["bytes"]["activations_blocks"] == blocks(BATCH, 4)


def test_formula_and_settings_errors():
    # Korthikanti et al.'s GPT-3-style example size: s = 2048, b = 1, h = 12288, a = 96 →
    # 34 + 5·96·2048/12288 = 114 bytes per s·b·h per layer.
    assert block_activation_bytes(1, 12288, 96, 2048, 1, False) == 2048 * 12288 * 114
    assert block_activation_bytes(1, 12288, 96, 2048, 1, True) == 2 * 2048 * 12288
    assert optimizer_states("AdamW") == 2
    with pytest.raises(ValueError, match="RMSprop"):
        optimizer_states("RMSprop")
    with pytest.raises(ValueError, match="trainer.precision '16'"):
        Engine(precision="16")
    with pytest.raises(ValueError, match="trainer.strategy 'deepspeed'"):
        Engine(strategy="deepspeed")
