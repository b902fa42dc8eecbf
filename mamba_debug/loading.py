"""`load_model`: HF-format folders (transformers' MambaForCausalLM and the original state-spaces layout)
and llama.cpp GGUF files, all translated to the canonical names of `weights.py`.

Every failure is a `CheckpointError` that names the file and the fix; pickled weights are only read
with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .config import MambaConfig
from .errors import CheckpointError
from .model import MambaModel
from .weights import check_params

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_MODEL = DATA_DIR / "tiny-mamba"

# model_type / architecture words that are recognisably not Mamba-1, with a readable name.
OTHER_ARCHS = {"mamba2": "Mamba-2", "falcon_mamba": "FalconMamba (Mamba-1 with dt/B/C RMS norms)",
               "jamba": "Jamba (hybrid attention + Mamba)", "zamba": "Zamba (hybrid)", "bamba": "Bamba (hybrid)",
               "nemotron_h": "Nemotron-H (hybrid)", "falcon_h1": "Falcon-H1 (hybrid)", "rwkv": "RWKV",
               "llama": "Llama (a transformer)", "gpt2": "GPT-2 (a transformer)", "mistral": "Mistral (a transformer)"}


def load_model(path=None) -> MambaModel:
    """Load a Mamba-1 model: an HF folder, a GGUF file, or (None) the tiny model shipped in data/."""
    if path is None:
        if not (DEFAULT_MODEL / "config.json").is_file():
            raise CheckpointError(f"the shipped tiny model is not in {DEFAULT_MODEL} yet; pass --model PATH "
                                  f"(an HF Mamba folder or a .gguf file)")
        path = DEFAULT_MODEL
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        if _is_gguf(path):
            from .gguf_io import load_gguf          # noqa: PLC0415 (optional dependency `gguf`)
            return load_gguf(path)
        if path.name == "config.json":
            path = path.parent
        else:
            raise CheckpointError(f"{path}: not a GGUF file (bad magic) and not a model folder; pass the folder "
                                  f"holding config.json, or a .gguf file")
    return load_hf_folder(path)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        magic = f.read(4)
    return magic == b"GGUF" or (path.suffix == ".gguf" and _raise_bad_gguf(path, magic))


def _raise_bad_gguf(path: Path, magic: bytes) -> bool:
    raise CheckpointError(f"{path}: named .gguf but starts with {magic!r}, not b'GGUF'; the file is damaged or "
                          f"not a GGUF file")


# -- HF folders ------------------------------------------------------------------------------------
def load_hf_folder(folder: Path) -> MambaModel:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: no config.json; an HF model folder needs config.json and weights")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from exc
    _reject_other_arch(raw, cfg_path)
    tensors = _read_tensors(folder)
    if "hidden_size" in raw or raw.get("model_type") == "mamba":
        cfg, params, names = _from_transformers(raw, tensors, cfg_path)
    elif "d_model" in raw:
        cfg, params, names = _from_state_spaces(raw, tensors, cfg_path)
    else:
        raise CheckpointError(f"{cfg_path}: neither transformers' Mamba config (hidden_size, state_size, ...) nor "
                              f"the state-spaces one (d_model, n_layer, ssm_cfg)")
    params = check_params(cfg, params, str(folder), names)
    return MambaModel(cfg, params, _read_tokenizer(folder), source=str(folder))


def _reject_other_arch(raw: dict, cfg_path: Path):
    words = [str(raw.get("model_type", "")).lower()] + [str(a).lower() for a in raw.get("architectures", [])]
    ssm_cfg = raw.get("ssm_cfg") or {}
    if str(ssm_cfg.get("layer", "")).lower() == "mamba2" or any("mamba2" in w for w in words):
        kind = "Mamba-2"
    else:
        kind = next((name for key, name in OTHER_ARCHS.items() for w in words if key in w.replace("-", "_")), None)
        if kind is None and raw.get("rms_norm") is False:
            kind = "a Mamba with LayerNorm instead of RMSNorm"
    if kind:
        raise CheckpointError(f"{cfg_path}: this looks like {kind}; mamba-debug supports Mamba-1 only (not yet "
                              f"{kind.split(' (')[0]})")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st_files = sorted(folder.glob("*.safetensors"))
    if st_files:
        from safetensors import safe_open  # noqa: PLC0415
        out = {}
        for f in st_files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for k in handle.keys():
                        out[k] = handle.get_tensor(k)
            except Exception as exc:
                raise CheckpointError(f"{f}: cannot be read as safetensors ({exc}); the file is truncated or "
                                      f"damaged: save or copy it again") from exc
        return out
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            try:
                out.update(torch.load(f, map_location="cpu", weights_only=True))
            except Exception as exc:
                raise CheckpointError(f"{f}: cannot be read with torch.load(weights_only=True) ({type(exc).__name__}: "
                                      f"{exc}); the file is truncated, damaged or holds more than tensors") from exc
        return out
    raise CheckpointError(f"{folder}: no weights (model*.safetensors or pytorch_model*.bin) next to config.json")


def _read_tokenizer(folder: Path):
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # noqa: PLC0415
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read by the tokenizers library ({exc})") from exc


def _layer_map(cfg: MambaConfig, prefix_embed: str):
    """canonical name -> file name for the parts both HF layouts share."""
    names = {"embed": prefix_embed, "norm_f": "backbone.norm_f.weight", "lm_head": "lm_head.weight"}
    for i in range(cfg.n_layer):
        f, c = f"backbone.layers.{i}.", f"layers.{i}."
        m = f + "mixer."
        names.update({c + "norm": f + "norm.weight", c + "in_proj": m + "in_proj.weight",
                      c + "in_proj_bias": m + "in_proj.bias", c + "conv_w": m + "conv1d.weight",
                      c + "conv_b": m + "conv1d.bias", c + "x_proj": m + "x_proj.weight",
                      c + "dt_proj": m + "dt_proj.weight", c + "dt_bias": m + "dt_proj.bias", c + "A": m + "A_log",
                      c + "D": m + "D", c + "out_proj": m + "out_proj.weight", c + "out_proj_bias": m + "out_proj.bias"})
    return names


def _translate(cfg: MambaConfig, tensors: dict, names: dict) -> dict[str, torch.Tensor]:
    params = {}
    for canon, fname in names.items():
        if fname not in tensors:
            continue
        t = tensors[fname]
        if canon.endswith(".conv_w") and t.dim() == 3 and t.shape[1] == 1:
            t = t[:, 0, :]                                   # conv1d weight [D, 1, K] -> [D, K]
        if canon.endswith(".A"):
            t = -torch.exp(t.to(torch.float64))              # A = -exp(A_log)
        params[canon] = t
    if "lm_head" not in params and cfg.tie_embeddings and "embed" in params:
        params["lm_head"] = params["embed"]
    if "embed" not in params and cfg.tie_embeddings and "lm_head" in params:
        params["embed"] = params["lm_head"]                  # safetensors may keep either name of a tied pair
    return params


def _vocab_rows(tensors: dict, keys: tuple, fallback: int) -> int:
    for k in keys:
        if k in tensors and tensors[k].dim() == 2:
            return tensors[k].shape[0]
    return fallback


def _from_transformers(raw: dict, tensors: dict, cfg_path: Path):
    try:
        E = raw["hidden_size"]
        cfg = MambaConfig(
            d_model=E, n_layer=raw["num_hidden_layers"],
            vocab_size=_vocab_rows(tensors, ("backbone.embeddings.weight", "lm_head.weight"), raw["vocab_size"]),
            d_state=raw.get("state_size", 16), d_conv=raw.get("conv_kernel", 4), expand=raw.get("expand", 2),
            d_inner=raw.get("intermediate_size") or 0, dt_rank=_dt_rank(raw.get("time_step_rank", "auto"), E),
            rms_eps=raw.get("layer_norm_epsilon", 1e-5), tie_embeddings=raw.get("tie_word_embeddings", True),
            conv_bias=raw.get("use_conv_bias", True), proj_bias=raw.get("use_bias", False))
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{cfg_path}: incomplete or invalid transformers Mamba config ({exc})") from exc
    names = _layer_map(cfg, "backbone.embeddings.weight")
    return cfg, _translate(cfg, tensors, names), names


def _from_state_spaces(raw: dict, tensors: dict, cfg_path: Path):
    ssm = raw.get("ssm_cfg") or {}
    try:
        E = raw["d_model"]
        cfg = MambaConfig(
            d_model=E, n_layer=raw["n_layer"],
            vocab_size=_vocab_rows(tensors, ("backbone.embedding.weight", "lm_head.weight"), raw["vocab_size"]),
            d_state=ssm.get("d_state", 16), d_conv=ssm.get("d_conv", 4), expand=ssm.get("expand", 2),
            dt_rank=_dt_rank(ssm.get("dt_rank", "auto"), E), rms_eps=raw.get("norm_epsilon", 1e-5),
            tie_embeddings=raw.get("tie_embeddings", True), conv_bias=ssm.get("conv_bias", True),
            proj_bias=ssm.get("bias", False))
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{cfg_path}: incomplete or invalid state-spaces Mamba config ({exc})") from exc
    names = _layer_map(cfg, "backbone.embedding.weight")
    return cfg, _translate(cfg, tensors, names), names


def _dt_rank(value, d_model: int) -> int:
    return math.ceil(d_model / 16) if value in ("auto", None) else int(value)
