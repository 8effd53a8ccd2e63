"""Bad checkpoints fail loudly, naming the file and the tensor; nothing is silently skipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from export.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint


@pytest.fixture()
def ckpt_copy(tmp_path) -> Path:
    """A writable copy of the default checkpoint directory."""
    source, _ = resolve_checkpoint("default")
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def _edit_weights(directory: Path, edit) -> None:
    weights = load_file(str(directory / "model.safetensors"))
    edit(weights)
    save_file(weights, str(directory / "model.safetensors"))


def test_a_copy_loads_like_the_original(ckpt_copy):
    ckpt = load_checkpoint(ckpt_copy)
    assert ckpt.name == "ckpt" and ckpt.config.n_layers == 6
    assert set(ckpt.ignored) == {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(ckpt_copy, missing):
    (ckpt_copy / missing).unlink()
    with pytest.raises(CheckpointError, match=missing if missing != "model.safetensors" else "no weights"):
        load_checkpoint(ckpt_copy)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_unknown_architecture_is_refused(ckpt_copy):
    config = json.loads((ckpt_copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    (ckpt_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt2' is not supported"):
        load_checkpoint(ckpt_copy)


def test_wrong_shape_names_the_tensor(ckpt_copy):
    def shrink(w):
        w["encoder.layer.2.attention.self.key.weight"] = torch.zeros(384, 192)

    _edit_weights(ckpt_copy, shrink)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor for layers.2.attention.w_k.weight has shape \(384, 192\)"):
        load_checkpoint(ckpt_copy)


def test_config_that_disagrees_with_weights(ckpt_copy):
    config = json.loads((ckpt_copy / "config.json").read_text())
    config["intermediate_size"] = 1024
    (ckpt_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.linear1.bias has shape \(1536,\), the config implies \(1024,\) \(and 17 more\)"):
        load_checkpoint(ckpt_copy)


def test_missing_weight_names_the_tensor(ckpt_copy):
    _edit_weights(ckpt_copy, lambda w: w.pop("encoder.layer.5.output.LayerNorm.bias"))
    with pytest.raises(CheckpointError, match=r"missing weight\(s\) for \['layers.5.norm2.bias'\]"):
        load_checkpoint(ckpt_copy)


def test_unused_weight_names_the_tensor(ckpt_copy):
    _edit_weights(ckpt_copy, lambda w: w.update({"encoder.layer.0.attention.self.rotary.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"no place for.*encoder.layer.0.attention.self.rotary.weight"):
        load_checkpoint(ckpt_copy)


def test_extra_layer_beyond_the_config_is_refused(ckpt_copy):
    def add_layer(w):
        w.update({k.replace("layer.5.", "layer.6."): v.clone() for k, v in list(w.items()) if "layer.5." in k})

    _edit_weights(ckpt_copy, add_layer)
    with pytest.raises(CheckpointError, match=r"layers.6.* map to no encoder parameter"):
        load_checkpoint(ckpt_copy)


def test_pytorch_model_bin_loads_too(ckpt_copy):
    weights = load_file(str(ckpt_copy / "model.safetensors"))
    (ckpt_copy / "model.safetensors").unlink()
    torch.save({f"bert.{k}": v for k, v in weights.items()}, ckpt_copy / "pytorch_model.bin")
    ckpt = load_checkpoint(ckpt_copy)
    torch.testing.assert_close(
        ckpt.encoder.layers[0].attention.w_q.weight, weights["encoder.layer.0.attention.self.query.weight"]
    )


def test_unsupported_pooling_is_refused(ckpt_copy):
    pool = ckpt_copy / "1_Pooling" / "config.json"
    config = json.loads(pool.read_text())
    config["pooling_mode_mean_sqrt_len_tokens"] = True
    pool.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"1_Pooling/config.json: pooling .* is not supported"):
        load_checkpoint(ckpt_copy)
