"""HF-format folders, read and written: transformers' `MambaForCausalLM` (config.json + model.safetensors
[+ tokenizer.json], as `save_pretrained` writes it) and the original state-spaces layout (read only);
`Mamba2ForCausalLM` and `GraniteMoeHybridForCausalLM` (dense) through the tables of `hf_mamba2`.

Each layout is one table (`LAYOUTS`): its config.json keys and its tensor names, both mapped to the canonical
ones (`ModelConfig` fields, `arch.param_shapes` names); the reader and the writer use the same table. Pickled
weights are only read with `torch.load(weights_only=True)`; every failure is a `CheckpointError`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..arch import param_shapes
from ..config import MambaConfig
from ..errors import CheckpointError, MambaDebugError
from ..limits import check_config_values, check_weight_bytes
from ..model import MambaModel, require_model
from ..safeio import atomic_path, write_text
from . import hf_mamba2
from .hf_files import check_extra_tensors, other_checkpoint_files, weights_files
from .weights import check_params


@dataclass(frozen=True)
class Layout:
    config: dict        # ModelConfig field -> config.json key ("ssm_cfg.d_state" = a key of the ssm_cfg object)
    names: dict         # model-level canonical name -> tensor name


# canonical layer parameter -> tensor name under "backbone.layers.{i}." (the same in both layouts)
LAYER_NAMES = {"norm": "norm.weight", "in_proj": "mixer.in_proj.weight", "in_proj_bias": "mixer.in_proj.bias",
               "conv_w": "mixer.conv1d.weight", "conv_b": "mixer.conv1d.bias", "x_proj": "mixer.x_proj.weight",
               "dt_proj": "mixer.dt_proj.weight", "dt_bias": "mixer.dt_proj.bias", "A": "mixer.A_log",
               "D": "mixer.D", "out_proj": "mixer.out_proj.weight", "out_proj_bias": "mixer.out_proj.bias"}

LAYOUTS = {
    "transformers": Layout(
        config={"d_model": "hidden_size", "n_layer": "num_hidden_layers", "vocab_size": "vocab_size",
                "d_state": "state_size", "d_conv": "conv_kernel", "expand": "expand", "d_inner": "intermediate_size",
                "dt_rank": "time_step_rank", "rms_eps": "layer_norm_epsilon", "tie_embeddings": "tie_word_embeddings",
                "conv_bias": "use_conv_bias", "proj_bias": "use_bias"},
        names={"embed": "backbone.embeddings.weight", "norm_f": "backbone.norm_f.weight", "lm_head": "lm_head.weight"}),
    "state-spaces": Layout(
        config={"d_model": "d_model", "n_layer": "n_layer", "vocab_size": "vocab_size", "d_state": "ssm_cfg.d_state",
                "d_conv": "ssm_cfg.d_conv", "expand": "ssm_cfg.expand", "dt_rank": "ssm_cfg.dt_rank",
                "rms_eps": "norm_epsilon", "tie_embeddings": "tie_embeddings", "conv_bias": "ssm_cfg.conv_bias",
                "proj_bias": "ssm_cfg.bias"},
        names={"embed": "backbone.embedding.weight", "norm_f": "backbone.norm_f.weight", "lm_head": "lm_head.weight"}),
}
REQUIRED = ("d_model", "n_layer", "vocab_size")       # config fields without a default


def tensor_names(cfg: MambaConfig, layout: str) -> dict[str, str]:
    """canonical name -> the layout's tensor name."""
    names = dict(LAYOUTS[layout].names)
    for i in range(cfg.n_layer):
        names.update({f"layers.{i}.{k}": f"backbone.layers.{i}.{v}" for k, v in LAYER_NAMES.items()})
    return names


def _from_file(key: str, t: torch.Tensor) -> torch.Tensor:
    if key.endswith(".conv_w") and t.dim() == 3 and t.shape[1] == 1:
        return t[:, 0, :]                                    # conv1d weight [D, 1, K] -> [D, K]
    if key.endswith(".A"):
        return -torch.exp(t.to(torch.float64))               # A = -exp(A_log)
    return t


def _to_file(key: str, t: torch.Tensor) -> torch.Tensor:
    if key.endswith(".conv_w"):
        return t[:, None, :]
    if key.endswith(".A"):
        return torch.log(-t)
    return t


# -- reading ---------------------------------------------------------------------------------------
def read_config(folder: Path) -> tuple[dict, Path]:
    """(the parsed config.json, its path)."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: no config.json; an HF model folder needs config.json and weights")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for k, v in raw.items() if k == "ssm_cfg" and v):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object of config keys (ssm_cfg an object too)")
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"{cfg_path}: architectures must be a list of class names such as "
                              f"[\"MambaForCausalLM\"], found {archs!r}")
    return raw, cfg_path


def load_hf_folder(folder: Path, raw: dict | None = None) -> MambaModel:
    """A transformers or state-spaces Mamba-1 folder (`raw`: its config.json, when the caller read it already)."""
    folder = Path(folder)
    if raw is None:
        raw, cfg_path = read_config(folder)
    else:
        cfg_path = folder / "config.json"
    tensors = _read_tensors(folder)
    if "hidden_size" in raw or raw.get("model_type") == "mamba":
        layout = "transformers"
    elif "d_model" in raw:
        layout = "state-spaces"
    else:
        raise CheckpointError(f"{cfg_path}: neither transformers' Mamba config (hidden_size, state_size, ...) nor "
                              f"the state-spaces one (d_model, n_layer, ssm_cfg)")
    cfg = _config(raw, tensors, cfg_path, layout)
    names = tensor_names(cfg, layout)
    if not cfg.conv_bias:       # transformers builds conv1d without a bias: a file's is ignored (and noted)
        names = {k: v for k, v in names.items() if not k.endswith(".conv_b")}
    extra = check_extra_tensors(tensors, set(names.values()) | {LAYOUTS[layout].names["lm_head"]}, cfg.n_layer,
                                folder)
    params = _translate(cfg, tensors, names)
    if not cfg.conv_bias:
        params.update({k: torch.zeros(shape, dtype=torch.float64) for k, shape in param_shapes(cfg).items()
                       if k.endswith(".conv_b")})
    params = check_params(cfg, params, str(folder), names)
    notes = [f"ignored tensors the config does not account for: {', '.join(extra[:4])}"] if extra else []
    return MambaModel(cfg, params, _read_tokenizer(folder), source=str(folder), notes=notes)


def load_hf_mamba2_folder(folder: Path, raw: dict) -> MambaModel:
    """A transformers Mamba-2 or Granite-4.0-H dense hybrid folder (no tokenizer files: token ids only)."""
    folder = Path(folder)
    where = str(folder / "config.json")
    cfg, notes = hf_mamba2.config_from_hf(raw, where)
    tensors = _read_tensors(folder)
    if hf_mamba2.model_type(raw) == "mamba_ssm2":            # the vocabulary is padded inside the checkpoint
        cfg.vocab_size = _vocab_rows(tensors, ("backbone.embedding.weight", "lm_head.weight"), cfg.vocab_size)
    if not cfg.tie_embeddings and "lm_head.weight" not in tensors:     # transformers would start a random head
        cfg.tie_embeddings = True
        notes.append("tie_word_embeddings is false but there is no lm_head.weight: the head is the embedding")
    extra = check_extra_tensors(tensors, hf_mamba2.tensor_names(cfg, tensors), cfg.n_layer, folder)
    if extra:
        notes.append(f"ignored tensors the config does not account for: {', '.join(extra[:4])}")
    shapes = param_shapes(cfg)
    params = check_params(cfg, hf_mamba2.params_from_hf(cfg, tensors, shapes, str(folder)), str(folder))
    tokenizer = _read_tokenizer(folder)
    if tokenizer is None:
        notes.append("no tokenizer.json: pass token ids")
    return MambaModel(cfg, params, tokenizer, source=str(folder), notes=notes)


def _lookup(raw: dict, key: str):
    """(found, value) of a config.json key; "a.b" looks in the object under "a" (absent or null = empty)."""
    head, _, tail = key.partition(".")
    if tail:
        raw, key = raw.get(head) or {}, tail
    return (key in raw), raw.get(key)


def _config(raw: dict, tensors: dict, cfg_path: Path, layout: str) -> MambaConfig:
    table = LAYOUTS[layout]
    hf_mamba2.check_activation(raw, cfg_path)
    try:
        kw = {}
        for field, key in table.config.items():
            found, value = _lookup(raw, key)
            if found:
                kw[field] = value
            elif field in REQUIRED:
                raise KeyError(key)
        kw["vocab_size"] = _vocab_rows(tensors, (table.names["embed"], table.names["lm_head"]), kw["vocab_size"])
        kw["d_inner"] = kw.get("d_inner") or 0
        check_config_values(kw, table.config, cfg_path)
        kw["dt_rank"] = _dt_rank(kw.get("dt_rank", "auto"), kw["d_model"])
        check_weight_bytes(kw, sum(t.numel() * t.element_size() for t in tensors.values()), cfg_path)
        return MambaConfig(**kw)
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise CheckpointError(f"{cfg_path}: incomplete or invalid {layout} Mamba config ({exc})") from exc


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files, _ = weights_files(folder)        # never a stray second weights file mixed in
    st_files = [f for f in files if f.suffix == ".safetensors"]
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
    bins = [f for f in files if f.suffix == ".bin"]
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


def _translate(cfg: MambaConfig, tensors: dict, names: dict) -> dict[str, torch.Tensor]:
    params = {canon: _from_file(canon, tensors[fname]) for canon, fname in names.items() if fname in tensors}
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


def _dt_rank(value, d_model: int) -> int:
    return math.ceil(d_model / 16) if value in ("auto", None) else int(value)


# -- writing ---------------------------------------------------------------------------------------
_SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _save_dtype(dtype) -> torch.dtype:
    """save_hf's dtype: a floating torch dtype or its name (an integer dtype wrote truncated weights)."""
    got = _SAVE_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if not (isinstance(got, torch.dtype) and got.is_floating_point):
        raise MambaDebugError(f"save_hf: dtype {dtype!r} is not a floating dtype; give one of "
                              f"{', '.join(list(_SAVE_DTYPES)[:4])} (or its torch dtype)")
    return got


def save_hf(model: MambaModel, folder, dtype: torch.dtype = torch.float32) -> Path:
    """Write `model` as a transformers `MambaForCausalLM` folder (`Mamba2ForCausalLM` or
    `GraniteMoeHybridForCausalLM` for those layer types): config.json + model.safetensors [+ tokenizer.json];
    `load_model` and transformers read it back."""
    from safetensors.torch import save_file  # noqa: PLC0415

    require_model(model, "save_hf")
    dtype = _save_dtype(dtype)
    c, folder = model.config, Path(folder)
    if folder.exists() and not folder.is_dir():
        raise MambaDebugError(f"{folder} is a file; save_hf writes a folder (config.json, model.safetensors)")
    stale = other_checkpoint_files(folder, model.tokenizer is not None) if folder.is_dir() else []
    if stale:
        raise MambaDebugError(f"{folder} holds {', '.join(stale[:4])}{' ...' if len(stale) > 4 else ''} of another "
                              f"checkpoint, which a reader would take with these weights; save into an empty folder "
                              f"or remove them")
    folder.mkdir(parents=True, exist_ok=True)
    if set(c.layer_types) != {"mamba1"}:                     # Mamba2ForCausalLM / GraniteMoeHybridForCausalLM
        tensors, config = hf_mamba2.params_to_hf(c, model.params, dtype), hf_mamba2.config_to_hf(c)
    else:
        table, names = LAYOUTS["transformers"], tensor_names(c, "transformers")
        tensors = {names[k]: _to_file(k, model.params[k]).to(dtype).contiguous() for k in param_shapes(c)
                   if not (k == "lm_head" and c.tie_embeddings)}
        config = {"architectures": ["MambaForCausalLM"], "model_type": "mamba",
                  **{key: getattr(c, field) for field, key in table.config.items()}, "residual_in_fp32": True}
    with atomic_path(folder / "model.safetensors") as tmp:
        save_file(tensors, str(tmp))
    write_text(folder / "config.json", json.dumps(config, indent=2))
    if model.tokenizer is not None:
        with atomic_path(folder / "tokenizer.json") as tmp:
            model.tokenizer.save(str(tmp))
    return folder
