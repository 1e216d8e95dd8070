"""``flatshard ckpt``: look into and convert checkpoint directories, on CPU, offline.

flatshard ckpt inspect DIR [--tensors]
flatshard ckpt export DIR OUT [--max-shard-size 5GB] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from flatshard.cli.config import ConfigError
from flatshard.cli.internals import (
    DEFAULT_SHARD_BYTES,
    EXTRA,
    GROUPS,
    MODEL,
    OPTIM,
    checkpoint_metadata,
    is_tensor_entry,
    load_raw,
    read_manifest,
    verify_files,
)
from flatshard.state import CheckpointError, export_checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "ckpt",
        help="inspect or export a checkpoint directory (CPU, no process group)",
        description="Look into and convert directories written by flatshard.save_checkpoint.",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="what a checkpoint holds; checks every file")
    inspect.add_argument("path", type=Path, help="checkpoint directory")
    inspect.add_argument("--tensors", action="store_true", help="list every model tensor")
    inspect.set_defaults(run=run_inspect, command_parser=inspect)
    export = actions.add_parser(
        "export",
        help="write the model weights as safetensors (Hugging Face layout)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    export.add_argument("path", type=Path, help="checkpoint directory")
    export.add_argument("out", type=Path, help="output directory")
    export.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file (e.g. 500MB, 5GB)"
    )
    export.add_argument(
        "--dtype", default="as-saved", help="cast floating tensors: as-saved | bf16 | fp16 | fp32"
    )
    export.set_defaults(run=run_export, command_parser=export)


def parse_size(text: str) -> int:
    """``5GB`` -> 5_000_000_000; ``512MiB``; a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size: expected a size such as 500MB or 5GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def run_export(args: argparse.Namespace) -> int:
    max_bytes = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_SHARD_BYTES
    if args.dtype != "as-saved" and args.dtype not in DTYPES:
        raise ConfigError(
            f"--dtype must be as-saved or one of {', '.join(DTYPES)}, got {args.dtype!r}"
        )
    try:
        files = export_checkpoint(
            args.path, args.out, max_shard_bytes=max_bytes, dtype=DTYPES.get(args.dtype)
        )
    except CheckpointError as error:
        raise ConfigError(str(error).removeprefix("flatshard: ")) from None
    print(f"wrote {len(files)} safetensors file(s) to {args.out}: {', '.join(files)}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    try:
        manifest = read_manifest(args.path)
        verify_files(args.path, manifest, None)
        saved = checkpoint_metadata(args.path).state_dict_metadata
    except CheckpointError as error:
        raise ConfigError(str(error).removeprefix("flatshard: ")) from None
    for line in describe(args.path, manifest, saved, args.tensors):
        print(line)
    return 0


def describe(
    path: Path, manifest: dict[str, Any], saved: dict[str, Any], tensors: bool
) -> list[str]:
    """The lines ``flatshard ckpt inspect`` prints."""
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values())
    model = {k[len(MODEL) :]: md for k, md in saved.items() if k.startswith(MODEL)}
    elements = sum(md.size.numel() for md in model.values() if is_tensor_entry(md))
    lines = [
        f"checkpoint  {path}",
        f"saved by    {manifest['world_size']} rank(s), torch {manifest['torch']}, "
        f"format {manifest['version']}",
        f"files       {len(files)}, {total / 2**20:.1f} MiB, sizes and checksums ok",
        f"model       {len(model)} tensors, {elements:,} elements",
    ]
    state_keys = sorted(
        {k.rpartition("/")[2] for k in saved if k.startswith(OPTIM) and not k.startswith(GROUPS)}
    )
    for key in sorted(k for k in saved if k.startswith(GROUPS)):
        holder: dict[str, Any] = {key: None}
        load_raw(path, holder)
        groups: list[dict[str, Any]] = holder[key] or []
        lines.append(
            f"optimizer   state {', '.join(state_keys) or '(none yet)'}; {len(groups)} "
            f"parameter group(s), lr {[g.get('lr') for g in groups]}"
        )
    if GROUPS not in saved:
        lines.append("optimizer   none saved")
    if f"{EXTRA}0" in saved:
        holder = {f"{EXTRA}0": None}
        load_raw(path, holder)
        lines.append(f"extra       (rank 0) {_short(holder[f'{EXTRA}0'])}")
    if tensors:
        lines.append("")
        width = max((len(n) for n in model), default=4)
        for name, md in model.items():
            if is_tensor_entry(md):
                dtype = str(md.properties.dtype).replace("torch.", "")
                lines.append(f"  {name:<{width}}  {dtype:<8} {tuple(md.size)}")
    return lines


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items()) or "{}"
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}>"
    if isinstance(value, list | tuple) and len(value) > 4:
        return f"<{type(value).__name__} of {len(value)}>"
    return repr(value)
