"""A Hugging Face encoder's frozen stem (``backbone.frozen_blocks``): the same features as the
whole model, computed once per distinct row, never adapted nor trained; and Deep Ensemble and
LoRA-Ensemble members that draw their own data order (``method.data_order: independent``)."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from uqbench.backbones.hf import HFEncoder
from uqbench.backbones.stem import FrozenRows
from uqbench.contracts import DataInfo, split_rows, stack_streams
from uqbench.methods.member_layers import repeat_members

pytestmark = pytest.mark.usefixtures("one_thread")
TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense",
           "output.dense"]
CONFIG = {"vocab_size": 30522, "hidden_size": 16, "num_hidden_layers": 3,
          "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64,
          "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
INFO = DataInfo(task="classification", num_classes=2)


def tiny(frozen_blocks: int = 0) -> HFEncoder:
    return HFEncoder(name="tiny", model_type="bert", config=CONFIG, pretrained=False,
                     pooling="mean", max_length=32, targets=TARGETS,
                     attention_targets=TARGETS[:4],
                     frozen_blocks=frozen_blocks)


def batch(backbone: HFEncoder, n: int = 5) -> dict[str, torch.Tensor]:
    words = ["a fine film", "dull and long", "the cast is superb", "not good at all",
             "an odd one"]
    return dict(backbone.tokenizer()(words[:n], padding=True, return_tensors="pt"))


def test_the_stem_gives_the_whole_models_features_from_the_distinct_rows_only():
    torch.manual_seed(0)
    plain = tiny().build().eval()
    torch.manual_seed(0)
    stemmed = tiny(2).build().eval()
    x = repeat_members(batch(tiny()), 4)                                      # (4·5, T)
    rows = []
    stem = stemmed.model.encoder.layer[0]
    assert isinstance(stem, FrozenRows)
    stem.base_layer.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    with torch.no_grad():
        torch.testing.assert_close(stemmed(x), plain(x), rtol=0, atol=1e-6)
    assert rows == [5]  # the 20 member-major rows are 4 copies of 5


@pytest.mark.parametrize("method, wrapped", [("sve", 6), ("lora_ensemble", 4),
                                             ("batch_ensemble", 6)])
def test_methods_adapt_only_above_the_stem_and_every_trainable_parameter_learns(
        cfg, method, wrapped):
    torch.manual_seed(0)
    c = cfg(f"method={method}", "method.members=2")
    m = instantiate(c.method)(backbone=tiny(2), info=INFO)
    assert len(m.replaced) == wrapped and all(".layer.2." in n for n in m.replaced)
    inputs = batch(tiny())
    m.train()
    m.loss((inputs, torch.tensor([1, 0, 1, 0, 1]))).backward()
    trainable = m.trainable_parameters()
    # every trainable parameter gets a gradient (LoRA's A: zero while B starts at 0)
    assert trainable and all(p.grad is not None for p in trainable.values())
    assert all(p.grad.abs().sum() > 0 for n, p in trainable.items() if "lora_A" not in n)
    stem = [n for n, _ in m.named_parameters() if ".layer.0." in n or ".layer.1." in n
            or "embeddings" in n]
    assert stem and not set(stem) & set(trainable)
    assert all(p.grad is None for n, p in m.named_parameters() if n in stem)


def test_fine_tuning_trains_the_blocks_above_the_stem_only(cfg):
    torch.manual_seed(0)
    m = instantiate(cfg("method=single").method)(backbone=tiny(2), info=INFO)
    names = set(m.trainable_parameters())
    assert any(".layer.2." in n for n in names) and any(n.startswith("head") for n in names)
    assert not any(".layer.0." in n or ".layer.1." in n or "embeddings" in n for n in names)
    full = instantiate(cfg("method=single").method)(backbone=tiny(), info=INFO)
    stem_count = sum(p.numel() for n, p in full.named_parameters()
                     if ".layer.0." in n or ".layer.1." in n or "embeddings" in n)
    assert m.param_counts()["trainable"] == full.param_counts()["trainable"] - stem_count


def test_the_stem_stays_deterministic_under_mc_dropout(cfg):
    torch.manual_seed(0)
    c = cfg("method=mc_dropout", "method.samples=3", "method.p=0.5")
    m = instantiate(c.method)(backbone=tiny(2), info=INFO)
    outs = []
    stem = m.encoder.model.encoder.layer[1]
    stem.register_forward_hook(lambda mod, args, out: outs.append(out.detach().clone()))
    m.eval()  # MC-Dropout keeps its dropouts on in evaluation
    with torch.no_grad():
        m(batch(tiny()))
        m(batch(tiny()))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not any(isinstance(x, torch.nn.Dropout) for x in stem.modules())


@pytest.mark.parametrize("blocks, match", [(3, "0 … 2"), (-1, "integer >= 0")])
def test_a_stem_that_leaves_nothing_to_adapt_is_refused(blocks, match):
    with pytest.raises(ValueError, match=match):
        tiny(blocks).build()


def test_streams_stack_stream_major_and_split_back():
    a = ({"input_ids": torch.ones(2, 3, dtype=torch.long),
          "attention_mask": torch.ones(2, 3, dtype=torch.long)}, torch.tensor([0, 1]))
    b = ({"input_ids": torch.full((2, 5), 7), "attention_mask": torch.ones(2, 5,
                                                                           dtype=torch.long)},
         torch.tensor([1, 1]))
    inputs, y = stack_streams([a, b])
    assert inputs["input_ids"].shape == (4, 5) and y.tolist() == [0, 1, 1, 1]
    assert inputs["attention_mask"][:2, 3:].sum() == 0  # padding is masked
    first, second = split_rows(inputs, 2)
    assert torch.equal(first["input_ids"][:, :3], a[0]["input_ids"])
    assert torch.equal(second["input_ids"], b[0]["input_ids"])


def sentences_of(input_ids: torch.Tensor) -> list[tuple]:
    """Each row's token ids without padding: the sentence it holds."""
    return [tuple(r[r != 0].tolist()) for r in input_ids]


def assert_own_batch_orders(cfg, method: str, watch) -> None:
    """Two epochs of fake_text with three members of ``method``: ``watch(m, seen)`` hooks the
    built method so that training inputs of member k land in ``seen[k]``. Each member must see
    every training sentence once per epoch, and no two members in the same order."""
    from uqbench.records.loggers import NullLogger
    from uqbench.tasks.classification import ClassificationTask

    c = cfg(f"method={method}", "method.members=3", "method.data_order=independent",
            "dataset=fake_text", "trainer=p1", "trainer.epochs=2")
    torch.manual_seed(0)
    data = instantiate(c.dataset)
    backbone = tiny()
    data.setup(backbone)
    m = instantiate(c.method)(backbone=backbone, info=data.info)
    assert m.data_streams() == 3 and m.settings()["data_order"] == "independent"
    seen: list[list[tuple]] = [[] for _ in range(3)]
    watch(m, seen)
    trainer = instantiate(c.trainer, progress=False, val_every=100)
    trainer.fit(m, data, ClassificationTask(), NullLogger())
    n = len(data.dataset("train"))
    sentences = sorted(s for inputs, _ in data.loader("train")
                       for s in sentences_of(inputs["input_ids"]))
    for member in seen:
        assert len(member) == 2 * n
        assert sorted(member[:n]) == sentences and sorted(member[n:]) == sentences
    assert seen[0] != seen[1] and seen[1] != seen[2] and seen[0] != seen[2]


def test_deep_ensemble_members_see_their_own_batch_orders(cfg):
    """Each encoder copy's training inputs are its member's."""
    def watch(m, seen):
        for k, enc in enumerate(m.de_encoders):
            enc.register_forward_pre_hook(
                lambda mod, args, k=k: seen[k].extend(sentences_of(args[0]["input_ids"]))
                if mod.training else None)

    assert_own_batch_orders(cfg, "deep_ensemble", watch)


def test_lora_ensemble_members_see_their_own_batch_orders(cfg):
    """One encoder, M·B rows per step, member-major: member k's rows are the k-th block."""
    def watch(m, seen):
        def record(mod, args):
            if mod.training:
                for k, rows in enumerate(split_rows(args[0], 3)):
                    seen[k].extend(sentences_of(rows["input_ids"]))

        m.encoder.register_forward_pre_hook(record)

    assert_own_batch_orders(cfg, "lora_ensemble_independent", watch)


def test_on_their_own_streams_each_member_is_scored_on_its_own_batch(cfg):
    """The training loss on a stacked step is (1/M) Σ_m CE(member m on batch m, y_m), each
    term computed here from member m's logits on batch m alone (evaluation mode, no dropout
    in the tiny model); the shared order's loss is that of every member on one batch."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    c = cfg("method=lora_ensemble_independent", "method.members=2")
    m = instantiate(c.method)(backbone=tiny(), info=INFO)
    with torch.no_grad():  # members that differ: B ≠ 0
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    b = batch(tiny(), 4)
    first = {k: v[:2] for k, v in b.items()}
    second = {k: v[2:] for k, v in b.items()}
    y1, y2 = torch.tensor([0, 1]), torch.tensor([1, 1])
    m.eval()
    with torch.no_grad():
        by_hand = 0.5 * (F.cross_entropy(m(first)[0].float(), y1)
                         + F.cross_entropy(m(second)[1].float(), y2))
        m.train()
        stacked = m.loss(stack_streams([(first, y1), (second, y2)]))
    torch.testing.assert_close(stacked, by_hand, rtol=1e-5, atol=1e-6)


def test_independent_order_is_refused_for_multiple_choice(cfg):
    c = cfg("method=lora_ensemble_independent")
    with pytest.raises(ValueError, match="data_order=independent needs a single-label"):
        instantiate(c.method)(backbone=tiny(), info=DataInfo(
            task="classification", num_classes=5, multiple_choice=True))
    c = cfg("method=lora_ensemble", "method.data_order=sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        instantiate(c.method)(backbone=tiny(), info=INFO)


def test_independent_order_needs_a_fine_tuned_ensemble_in_one_job(cfg):
    c = cfg("method=deep_ensemble", "method.data_order=independent", "method.member=1")
    with pytest.raises(ValueError, match="data_order=independent"):
        instantiate(c.method)(backbone=tiny(), info=INFO)
