"""HF model directories: sharded safetensors + index + config files, as transformers writes them.

Written with huggingface_hub's save_torch_state_dict, the writer transformers' save_pretrained
uses: shards `model-00001-of-0000N.safetensors` with `{"format": "pt"}` metadata and
`model.safetensors.index.json` (one `model.safetensors` when the state fits in one shard), so a
directory opens with `from_pretrained`, vLLM and SGLang as is. Publisher anchors and the
subscriber's directory sink both use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pulsesync.dtypes import State

WEIGHTS_PATTERN = "model{suffix}.safetensors"
WEIGHT_SUFFIX = ".safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"-\d{5}-of-(\d{5})\.safetensors$")  # HF shard names: the index must follow
PIECES_FILE = "pieces-{rank:05d}-of-{world:05d}.safetensors"  # a sharded anchor: one per rank
PIECES_METADATA = "pulsesync.pieces"  # JSON {name: [flat start, global shape, runs, stride]} of a pieces file's tensors


def write_model_dir(state: State, out_dir: Path, shard_size: int, files: Mapping[str, bytes]) -> list[str]:
    """Write the state's shards (and index) and the files into out_dir; returns their names, weights first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(dict(state), out_dir, filename_pattern=WEIGHTS_PATTERN, max_shard_size=shard_size)
    weights = sorted(p.name for p in out_dir.iterdir())
    for name, data in sorted(files.items()):
        if name in weights:
            raise ValueError(f"file {name!r} would replace a weights file")
        (out_dir / name).write_bytes(data)
    return weights + sorted(files)


def write_pieces(
    path: Path, tensors: Mapping[str, torch.Tensor], places: Mapping[str, tuple[int, list[int], int, int]]
) -> None:
    """One rank's pieces of a sharded anchor: local tensors, and where each sits in its global tensor
    (flat start, global shape, runs, stride)."""
    metadata = {"format": "pt", PIECES_METADATA: json.dumps(dict(places), sort_keys=True, separators=(",", ":"))}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata=metadata)


def pieces_metadata(path: Path) -> str | None:
    """The pieces metadata of a safetensors file (None: an ordinary shard of whole tensors); unparsed, untrusted."""
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    return metadata.get(PIECES_METADATA)


def load_owned(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors in process memory, not backed by the file's mmap.

    load_file maps the file: the first write to each page then copies it (patching a freshly
    loaded state measured ~10x slower), and the file, often a temporary one, stays mapped.
    """
    return {name: t.clone() for name, t in load_file(str(path)).items()}
