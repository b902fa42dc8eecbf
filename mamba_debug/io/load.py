"""`load_model`: a path to the right reader (HF folder or GGUF file, sniffed), a model shipped in data/ by name
("tiny-mamba2"), or the default tiny model.

Models of an architecture mamba-debug does not read are refused here with their name, before any weight is read.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..model import MambaModel
from ..shipped import shipped_dir
from .gguf_mamba2 import load_gguf
from .hf import load_hf_folder, load_hf_mamba2_folder, read_config
from .hf_mamba2 import model_type

DATA_DIR = shipped_dir("data")
DEFAULT_MODEL = DATA_DIR / "tiny-mamba"

# model_type / architecture words that are recognisably not Mamba-1, with a readable name.
OTHER_ARCHS = {"mamba2": "Mamba-2", "falcon_mamba": "FalconMamba (Mamba-1 with dt/B/C RMS norms)",
               "jamba": "Jamba (hybrid attention + Mamba)", "zamba": "Zamba (hybrid)", "bamba": "Bamba (hybrid)",
               "nemotron_h": "Nemotron-H (hybrid)", "falcon_h1": "Falcon-H1 (hybrid)", "rwkv": "RWKV",
               "llama": "Llama (a transformer)", "gpt2": "GPT-2 (a transformer)", "mistral": "Mistral (a transformer)"}


def load_model(path=None) -> MambaModel:
    """Load a model: an HF folder, a GGUF file, the name of a model shipped in data/ ("tiny-mamba2"), or (None)
    the default tiny Mamba-1 model."""
    if path is None:
        if not (DEFAULT_MODEL / "config.json").is_file():
            raise CheckpointError(f"the shipped tiny model is not in {DEFAULT_MODEL} yet; pass --model PATH "
                                  f"(an HF Mamba folder or a .gguf file)")
        path = DEFAULT_MODEL
    path = Path(path)
    if not path.exists() and len(path.parts) == 1 and (DATA_DIR / path / "config.json").is_file():
        path = DATA_DIR / path                               # a shipped model by name, from any working folder
    if not path.exists():
        shipped = sorted(p.parent.name for p in DATA_DIR.glob("*/config.json"))
        raise CheckpointError(f"{path}: no such file or folder (shipped models, by name: {', '.join(shipped)})")
    if path.is_file():
        if _is_gguf(path):
            return load_gguf(path)
        if path.name == "config.json":
            path = path.parent
        else:
            raise CheckpointError(f"{path}: not a GGUF file (bad magic) and not a model folder; pass the folder "
                                  f"holding config.json, or a .gguf file")
    raw, cfg_path = read_config(path)
    if model_type(raw) is not None:
        return load_hf_mamba2_folder(path, raw)
    _reject_other_arch(raw, cfg_path)
    return load_hf_folder(path, raw)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        magic = f.read(4)
    return magic == b"GGUF" or (path.suffix == ".gguf" and _raise_bad_gguf(path, magic))


def _raise_bad_gguf(path: Path, magic: bytes) -> bool:
    raise CheckpointError(f"{path}: named .gguf but starts with {magic!r}, not b'GGUF'; the file is damaged or "
                          f"not a GGUF file")


def _reject_other_arch(raw: dict, cfg_path: Path):
    archs = raw.get("architectures") or []
    words = [str(raw.get("model_type", "")).lower()] + [str(a).lower() for a in
                                                         (archs if isinstance(archs, list) else [archs])]
    ssm_cfg = raw.get("ssm_cfg") or {}
    if str(ssm_cfg.get("layer", "")).lower() == "mamba2" or any("mamba2" in w for w in words):
        kind = "Mamba-2"
    else:
        kind = next((name for key, name in OTHER_ARCHS.items() for w in words if key in w.replace("-", "_")), None)
        if kind is None and raw.get("rms_norm") is False:
            kind = "a Mamba with LayerNorm instead of RMSNorm"
    if kind:
        raise CheckpointError(f"{cfg_path}: this looks like {kind}; mamba-debug supports Mamba-1, and Mamba-2 and "
                              f"Granite-4.0-H dense hybrids in transformers' format (not yet {kind.split(' (')[0]})")
