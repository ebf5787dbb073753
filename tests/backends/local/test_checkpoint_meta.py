"""`checkpoints.CheckpointMeta`: the `meta.json` of a checkpoint keeps the on-disk format that
checkpoints saved before it existed have (same file name, same keys), so they still load."""

import json

import pytest

from oneloop.backends.megatron_local.checkpoints import META_FILE, CheckpointMeta, TinkerPath
from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.errors import CheckpointNotFoundError

# As the local backend wrote them before `CheckpointMeta` existed (sorted keys, indent 1).
OLD_TRAINING = {
    "base_model": "oneloop/tiny-qwen3",
    "kind": "weights",
    "lora_rank": 4,
    "model_dir": "/models/tiny",
    "name": "step-3",
    "run_id": "run-0123456789ab",
    "sync_version": 7,
    "train_attn": True,
    "train_mlp": False,
    "train_unembed": True,
    "user_metadata": {"step": "3"},
}
OLD_SAMPLER = {k: v for k, v in OLD_TRAINING.items() if k != "user_metadata"} | {
    "kind": "sampler_weights"
}


@pytest.mark.parametrize("old", [OLD_TRAINING, OLD_SAMPLER])
def test_old_meta_files_load_and_rewrite_byte_for_byte(tmp_path, old):
    text = json.dumps(old, indent=1, sort_keys=True)
    (tmp_path / META_FILE).write_text(text)
    meta = CheckpointMeta.read(tmp_path)
    assert meta.sync_version == 7 and meta.base_model == "oneloop/tiny-qwen3"
    assert meta.lora == LoraSpec(4, None, train_mlp=False, train_attn=True, train_unembed=True)
    out = tmp_path / "copy"
    out.mkdir()
    meta.write(out)
    assert (out / META_FILE).read_text() == text
    assert not (out / (META_FILE + ".tmp")).exists()


def test_with_version_sets_only_the_version():
    meta = CheckpointMeta.from_json(OLD_TRAINING)
    assert meta.with_version(9) == CheckpointMeta.from_json({**OLD_TRAINING, "sync_version": 9})


def test_a_directory_without_meta_is_no_checkpoint(tmp_path):
    path = TinkerPath.parse("tinker://run-1/weights/a")
    path.directory(tmp_path).mkdir(parents=True)
    with pytest.raises(CheckpointNotFoundError):
        path.existing_directory(tmp_path)
