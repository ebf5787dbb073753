"""`checkpoints.CheckpointMeta`: the `meta.json` of a checkpoint keeps the on-disk format that
checkpoints saved before it existed have (same file name, same keys), so they still load. And a
save is staged: a crash mid-save leaves no directory where the checkpoint goes, and the staging a
killed writer left is swept."""

import json
import os
import socket
import subprocess
import sys

import pytest

from oneloop.backends.megatron_local.checkpoints import (
    META_FILE,
    OWNER_FILE,
    CheckpointMeta,
    TinkerPath,
    staged,
    staging_directory,
    sweep_partials,
)
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


def test_a_save_is_staged_and_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "run-0123456789ab" / "weights" / "step-3"
    target.mkdir(parents=True)
    (target / "old.bin").write_bytes(b"old")  # an earlier checkpoint of that name (overwrite)
    with staged(target) as path:
        assert path == staging_directory(target) and path.name == ".step-3.partial"
        assert json.loads((path / OWNER_FILE).read_text())["pid"] == os.getpid()
        (path / "model.safetensors").write_bytes(b"new")
        CheckpointMeta.from_json(OLD_TRAINING).write(path)
        assert (target / "old.bin").exists()  # the old one stays whole until the new one is
    assert sorted(p.name for p in target.iterdir()) == [META_FILE, "model.safetensors"]
    assert not path.exists()
    with pytest.raises(OSError):  # a save that fails leaves neither a staging nor a change
        with staged(target) as path:
            (path / "model.safetensors").write_bytes(b"half")
            raise OSError("disk full")
    assert not path.exists() and (target / "model.safetensors").read_bytes() == b"new"


def test_the_staging_of_a_killed_writer_is_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stagings = {}
    for name, pid in (("dead", int(dead.stdout)), ("live", os.getpid())):
        staging = staging_directory(tmp_path / "run-0123456789ab" / "weights" / name)
        staging.mkdir(parents=True)
        (staging / "rank0.pt").write_bytes(b"half")
        owner = {"host": socket.gethostname(), "pid": pid}
        (staging / OWNER_FILE).write_text(json.dumps(owner))
        stagings[name] = staging
    assert sweep_partials(tmp_path) == [stagings["dead"]]
    assert not stagings["dead"].exists() and stagings["live"].exists()
