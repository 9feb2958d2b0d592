"""Missing pretrained weights: the error names where uqbench looked and the Hub CLI command
that fetches them, and that command, run by the pinned `hf` CLI (its download replaced by a
local copy: no network), writes exactly what the backbone then loads."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from click.testing import CliRunner
from hydra.utils import instantiate

from tests.helpers import ROOT


def hf(command: str, fake_download: mock.Mock) -> None:
    """Run a printed ``HF_HUB_OFFLINE=0 hf download …`` line with the pinned huggingface_hub
    CLI, its network calls replaced by ``fake_download``."""
    import huggingface_hub.cli.download as cli
    from huggingface_hub.cli.hf import app

    words = shlex.split(command)
    assert words[:2] == ["HF_HUB_OFFLINE=0", "hf"], command
    with mock.patch.object(cli, "hf_hub_download", fake_download), \
            mock.patch.object(cli, "snapshot_download", fake_download):
        result = CliRunner().invoke(app, words[2:])
    assert result.exit_code == 0, (result.output, result.exception)
    assert fake_download.called


def printed_command(message: str) -> str:
    line, = [ln.strip() for ln in message.splitlines() if " hf download " in ln]
    return line


def test_missing_timm_weights_name_both_places_and_the_command_fills_one(cfg, tmp_path):
    import safetensors.torch as st

    wanted = tmp_path / "ckpt" / "vit_tiny_patch16_224.safetensors"
    bb = instantiate(cfg("backbone=tiny_vit", "backbone.pretrained=true",
                         f"backbone.checkpoint={wanted}").backbone)
    with pytest.raises(FileNotFoundError) as err:
        bb.build()
    message = str(err.value)
    folder = tmp_path / "ckpt" / "vit_tiny_patch16_224"
    assert f"at {wanted} and in {folder}/" in message and "tiny_vit" in message
    command = printed_command(message)
    # timm's own pretrained config names the Hub repository of the default tag
    assert command == ("HF_HUB_OFFLINE=0 hf download timm/vit_tiny_patch16_224.augreg_in21k_"
                       f"ft_in1k model.safetensors --local-dir {folder}")

    source = instantiate(cfg("backbone=tiny_vit").backbone).build()  # "the Hub's" weights

    def download(repo_id, filename, local_dir, **_):  # what hf_hub_download does with local_dir
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        st.save_file(source.state_dict(), Path(local_dir) / filename)
        return str(Path(local_dir) / filename)

    hf(command, mock.Mock(side_effect=download))
    loaded = bb.build()  # the configured file is still absent: the folder is read
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_missing_llama_weights_explain_gated_access_and_the_download(cfg, tmp_path):
    bb = instantiate(cfg("backbone=llama2_7b", f"paths.checkpoints={tmp_path}").backbone)
    with pytest.raises(FileNotFoundError) as err:
        bb.hf_config()
    message = str(err.value)
    assert f"{tmp_path}/Llama-2-7b-hf has no config.json" in message
    assert printed_command(message).startswith(
        f"HF_HUB_OFFLINE=0 hf download meta-llama/Llama-2-7b-hf --local-dir "
        f"{tmp_path}/Llama-2-7b-hf --include")
    for step in ("accept the license on https://huggingface.co/meta-llama/Llama-2-7b-hf",
                 "https://huggingface.co/settings/tokens", "`hf auth login`"):
        assert step in message
    assert "save_pretrained" not in message and "from_pretrained" not in message


def test_the_hf_command_downloads_what_the_encoder_loads_and_not_the_other_formats(cfg,
                                                                                  tmp_path):
    """A stand-in Hub repository: a tiny BERT saved with its tokenizer, plus the copies in
    other formats that real repositories hold. The printed command's --include patterns,
    applied by huggingface_hub's own filter, must keep what the encoder needs and drop those."""
    from huggingface_hub.utils import filter_repo_objects
    from transformers import AutoTokenizer

    from uqbench.backbones.hf import bundled_tokenizer_path

    repo = tmp_path / "hub"
    source = instantiate(cfg("backbone=tiny_bert").backbone).build()
    source.model.save_pretrained(repo)
    AutoTokenizer.from_pretrained(bundled_tokenizer_path()).save_pretrained(repo)
    for other in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"):
        (repo / other).write_bytes(b"the same weights in another format")

    target = tmp_path / "ckpt" / "bert-tiny"
    bb = instantiate(cfg("backbone=tiny_bert", "backbone.pretrained=true",
                         f"backbone.path={target}", "+backbone.hub_id=someone/bert-tiny").backbone)
    with pytest.raises(FileNotFoundError) as err:
        bb.build()
    command = printed_command(str(err.value))

    def download(repo_id, local_dir, allow_patterns=None, ignore_patterns=None, **_):
        assert repo_id == "someone/bert-tiny"
        files = [p.name for p in repo.iterdir()]
        for name in filter_repo_objects(files, allow_patterns=allow_patterns,
                                        ignore_patterns=ignore_patterns):
            Path(local_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / name, Path(local_dir) / name)
        return local_dir

    hf(command, mock.Mock(side_effect=download))
    assert not {"pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"} & {
        p.name for p in target.iterdir()}
    loaded = bb.build()
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert bb.tokenizer()("a good movie")["input_ids"][:2] == [101, 1037]  # [CLS], "a"


@pytest.mark.parametrize("backbone", ["dino_vits16", "bert_base", "llama2_7b"])
def test_the_docs_give_the_same_commands_as_the_errors(cfg, backbone):
    bb = instantiate(cfg(f"backbone={backbone}", "paths.checkpoints=checkpoints").backbone)
    with pytest.raises(FileNotFoundError) as err:
        bb.build()
    command = printed_command(str(err.value)).removeprefix("HF_HUB_OFFLINE=0 ")
    assert command in (ROOT / "docs" / "p1.md").read_text()  # its "Pretrained weights"
