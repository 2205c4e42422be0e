"""A short digest of what a ModelSource will build, for ranks on several machines to check they
load the same model (distributed/rendezvous.py): the config, and for real weights each file's
name, size and a 64 KiB sample from its middle (a sample, not a hash of every byte: the check
runs at every start-up, and two checkpoints of one architecture differ everywhere but in their
headers). Paths are left out: nodes may keep the model in different places."""
from __future__ import annotations

import hashlib
import json
import os

from radixserve.loader.model_source import ModelSource
from radixserve.loader.weight_files import weight_files

SAMPLE_BYTES = 64 * 1024


def model_digest(source: ModelSource) -> str:
    digest = hashlib.sha256(json.dumps(source.hf_config, sort_keys=True, default=str).encode())
    digest.update(source.format.encode())
    for path in _weight_files(source):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            f.seek(max(size // 2 - SAMPLE_BYTES // 2, 0))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _weight_files(source: ModelSource) -> list[str]:
    if source.format == "gguf":
        return [source.model_path]
    if source.format == "dummy":
        return []  # random weights, from the seed every rank shares
    return weight_files(source.model_path)  # safetensors or pytorch_model*.bin
