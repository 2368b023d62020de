"""Checkpoint integrity: a safetensors checkpoint is checked from its headers and file sizes before loading.

What an interrupted download or a full disk leaves (a truncated file, a corrupt header, a shard missing from
an index) otherwise surfaces as a deep library traceback, or worse, as a model that loads and answers
garbage. Reading the headers costs a few kilobytes per file, so the target and draft loaders run these
checks on every start and `ddtree pull` runs them on what it downloaded; each problem is one line.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ddtree.errors import DDTreeError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "C64": 64, "F64": 64, "I64": 64, "U64": 64}
# The dtypes of an unquantized model's weights; anything else needs the config's quantization_config.
PLAIN_FLOATS = {"F16", "BF16", "F32", "F64"}
MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit
AGAIN = "; pull it again (`ddtree pull` re-fetches damaged files)"


class CheckpointError(DDTreeError):
    """A checkpoint file is damaged or incomplete (pull it again)."""


def read_header(path: Path) -> dict[str, dict]:
    """The tensors a safetensors file declares ({name: {dtype, shape, data_offsets}}), after checking that
    the file holds exactly the bytes its header describes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            if length is None or length > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path} is not a safetensors file or is truncated ({size} bytes){AGAIN}")
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path} has a corrupt header (not JSON){AGAIN}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt header (not a JSON object){AGAIN}")
    header.pop("__metadata__", None)
    end = 0
    for name, info in sorted(header.items(), key=lambda item: _offsets(path, *item)[0]):
        begin, stop = _offsets(path, name, info)
        if begin != end:
            raise CheckpointError(f"{path} has a corrupt header (tensor {name} starts at byte {begin}, not {end})"
                                  f"{AGAIN}")
        dtype, shape = info.get("dtype"), info.get("shape")
        if dtype not in DTYPE_BITS:
            raise CheckpointError(f"{path}: tensor {name} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{path} has a corrupt header (tensor {name} has shape {shape!r}){AGAIN}")
        if math.prod(shape) * DTYPE_BITS[dtype] != (stop - begin) * 8:
            raise CheckpointError(f"{path}: tensor {name} ({dtype} {shape}) needs "
                                  f"{math.prod(shape) * DTYPE_BITS[dtype] // 8} bytes, the header gives it "
                                  f"{stop - begin}{AGAIN}")
        end = stop
    data = size - 8 - length
    if data < end:
        raise CheckpointError(f"{path} is truncated: {size} bytes, its header describes {8 + length + end} "
                              f"(an interrupted download?){AGAIN}")
    if data > end:
        raise CheckpointError(f"{path} has {data - end} bytes after its last tensor{AGAIN}")
    return header


def _offsets(path: Path, name: str, info: object) -> tuple[int, int]:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path} has a corrupt header (tensor {name} has data_offsets {offsets!r}){AGAIN}")
    return offsets[0], offsets[1]


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files a checkpoint directory's weights live in: model.safetensors, or every shard
    its index names (all of them present); [] for a directory without safetensors weights."""
    index = directory / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            shards = None
        if not shards or not all(isinstance(s, str) for s in shards):
            raise CheckpointError(f"{index} is corrupt (no weight_map of tensor names to shard files){AGAIN}")
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{directory}: shard {missing[0]}{more} listed in {INDEX} is missing "
                                  f"(an interrupted download?){AGAIN}")
        return [directory / s for s in shards]
    single = directory / SINGLE
    return [single] if single.is_file() else []


def check_checkpoint(directory: Path, *, quantized: bool = False) -> dict[str, dict]:
    """Check every safetensors file of a checkpoint directory; returns the tensors they declare. Weights
    (`*.weight`) must be floating point unless the checkpoint is `quantized` (its config says how)."""
    tensors: dict[str, dict] = {}
    for path in weight_files(directory):
        header = read_header(path)
        if not quantized:
            for name, info in header.items():
                if name.endswith(".weight") and info["dtype"] not in PLAIN_FLOATS:
                    raise CheckpointError(f"{path}: tensor {name} is {info['dtype']}, not a float dtype "
                                          "(a quantized checkpoint without a quantization_config?)")
        tensors.update(header)
    return tensors
