"""Which files of an HF model folder hold its weights, and which tensors the config does not account for.

Only weights files are read (README, generation_config.json, a saved trace ... are not); a second candidate is never
mixed in: the standard single file (`model.safetensors`, `pytorch_model.bin`) is the weights, else the index
(`model.safetensors.index.json`, `pytorch_model.bin.index.json`) names the shards, else the folder's one candidate
(transformers' order: with both, an index left from an older save was read, not the file written since); several
candidates and nothing that decides between them is a refusal naming them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import CheckpointError

KINDS = (("model.safetensors", "*.safetensors"), ("pytorch_model.bin", "pytorch_model*.bin"))


def weights_files(folder: Path) -> tuple[list, list]:
    """(the weights files to read, other candidates left alone)."""
    for single, pattern in KINDS:
        candidates = sorted(folder.glob(pattern))
        index = folder / (single + ".index.json")
        if (folder / single).is_file():
            return [folder / single], [c for c in candidates if c != folder / single]
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a valid weights index ({exc}); fix or remove it") from exc
            files = [folder / s for s in shards]
            missing = [str(f) for f in files if not f.is_file() or f.parent.resolve() != folder.resolve()]
            if missing:
                raise CheckpointError(f"{index}: names shard(s) {', '.join(missing[:3])} that are not files of "
                                      f"{folder}; the download is incomplete")
            return files, [c for c in candidates if c not in files]
        if len(candidates) == 1:
            return candidates, []
        if len(candidates) > 1:
            names = ", ".join(c.name for c in candidates)
            raise CheckpointError(f"{folder}: several weights files ({names}) and no {single}.index.json saying "
                                  f"which belong to the model; remove the stray ones or add the index")
    return [], []


def other_checkpoint_files(folder: Path, keeps_tokenizer: bool) -> list:
    """What a save into `folder` (config.json, model.safetensors [, tokenizer.json]) would leave beside its own
    files for a reader to take: other weights files and indexes, a tokenizer.json when the model has none."""
    ours = {"model.safetensors"}
    out = [p.name for _, pattern in KINDS for p in sorted(folder.glob(pattern)) if p.name not in ours]
    out += [p.name for p in sorted(folder.glob("*.index.json"))]
    if not keeps_tokenizer and (folder / "tokenizer.json").is_file():
        out.append("tokenizer.json")
    return out


_LAYER = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.")     # Mamba-1 and -2; Granite


def check_extra_tensors(tensors: dict, known: set, n_layer: int, source) -> list:
    """Refuse tensors of layers the config does not have; return the other unknown names (a loader note)."""
    extra = sorted(set(tensors) - known)
    beyond = sorted({int(m.group(1)) for k in extra if (m := _LAYER.match(k)) and int(m.group(1)) >= n_layer})
    if beyond:
        raise CheckpointError(f"{source}: the weights hold layer(s) {', '.join(map(str, beyond[:5]))} but the config "
                              f"declares {n_layer} layers; the config does not match the weights (fix n_layer)")
    return extra
