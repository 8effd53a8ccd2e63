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


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize(("family", "key"), [("modernbert", "global_attn_every_n_layers"),
                                             ("gemma3", "sliding_window_pattern")])
@pytest.mark.parametrize("value", [0, -2, 1.5, "3"])
def test_a_layer_pattern_of_zero_or_not_a_count_is_refused_by_name(family, key, value, tmp_path):
    """A period of 0 divided by zero in export/families/ (ZeroDivisionError) instead of a refusal."""
    from tests.families import make_checkpoint

    directory = make_checkpoint(family, tmp_path / family)
    config = json.loads((directory / "config.json").read_text())
    config.pop("layer_types", None)  # the older layout, where the period says which layers are local
    (directory / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(directory)
    assert str(caught.value) == (f"{directory / 'config.json'}: {key} {value!r} is not a whole number of layers "
                                 "of 1 or more")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("vocab_size", 10**13, "vocab_size 10000000000000 is not a whole number from 1 to 16,777,216"),
    ("max_position_embeddings", 10**9, "max_position_embeddings 1000000000 is not a whole number from 1 to 1,048,576"),
    ("vocab_size", -1, "vocab_size -1 is not a whole number from 1 to 16,777,216"),
    ("hidden_size", "384", "hidden_size '384' is not a whole number from 1 to 16,777,216"),
    ("num_attention_heads", 0, "num_attention_heads 0 is not a whole number from 1 to 16,777,216"),
    ("num_hidden_layers", 100_000, "model.safetensors: config.json says 100000 layers, the weights hold 6"),
])
def test_a_hostile_size_is_refused_before_anything_is_built_from_it(ckpt_copy, key, value, message):
    """Sizes out of every bound are refused by name, not allocated (10**13 rows) or divided by (0 heads)."""
    _edit_config(ckpt_copy, **{key: value})
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(ckpt_copy)
    assert message in str(caught.value) and "\n" not in str(caught.value)


_PEAK_MEMORY = """
import json, resource, sys
from pathlib import Path
from export.checkpoint import CheckpointError, load_checkpoint
good, bad = Path(sys.argv[1]), Path(sys.argv[2])
load_checkpoint(good)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_checkpoint(bad)
    message = None
except CheckpointError as exc:
    message = str(exc)
print(json.dumps({"grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "message": message}))
"""


@pytest.mark.parametrize(("key", "tensor"), [("vocab_size", "embeddings.token.weight"),
                                              ("max_position_embeddings", "embeddings.position.weight")])
def test_a_size_the_weights_do_not_bear_out_allocates_nothing(ckpt_copy, key, tensor):
    """Within the bounds but not the weights' shape: refused from the shapes alone. Before, the encoder's table was
    built first (a million rows x 384 = 1.5 GB, filled at random) and only then compared with the weights."""
    import subprocess
    import sys

    _edit_config(ckpt_copy, **{key: 1_000_000})
    result = subprocess.run([sys.executable, "-c", _PEAK_MEMORY, str(resolve_checkpoint("default")[0]), str(ckpt_copy)],
                            capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["message"] is not None and f"tensor for {tensor} has shape" in seen["message"], seen
    assert "the config implies (1000000, 384)" in seen["message"], seen
    assert seen["grew_kib"] < 200_000, seen  # peak memory: none of the table's 1.5 GB (measured 0 KiB)


@pytest.mark.parametrize("path", ["/etc", "../elsewhere", "1_Pooling/../../elsewhere"])
def test_a_module_path_outside_the_checkpoint_is_refused(ckpt_copy, path):
    """modules.json's paths name folders inside the checkpoint; an absolute one or `..` read files from outside."""
    modules = json.loads((ckpt_copy / "modules.json").read_text())
    outside = ckpt_copy.parent / "elsewhere"
    shutil.copytree(ckpt_copy / "1_Pooling", outside)  # a readable Pooling config outside the checkpoint
    modules[1]["path"] = path
    (ckpt_copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(ckpt_copy)
    assert str(caught.value) == (f"{ckpt_copy / 'modules.json'}: module 'sentence_transformers.models.Pooling' has "
                                 f"path {path!r}, which is not a folder inside the checkpoint (absolute paths and '..' "
                                 "are refused)")
