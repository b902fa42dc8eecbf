"""transformers' Mamba-2 (`Mamba2ForCausalLM`) and Granite-4.0-H dense hybrid (`GraniteMoeHybridForCausalLM`)
checkpoints: config.json -> `ModelConfig`, state-dict names <-> the canonical names of `arch.param_shapes`.

Pure translation, no file access: `io.hf` reads the folder and hands over the parsed config and the tensors.
A mixture-of-experts Granite (num_local_experts > 0) and RoPE attention are refused, naming the field.
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..errors import CheckpointError
from ..limits import check_config_values

MODEL_TYPES = ("mamba2", "granitemoehybrid")
ARCHITECTURES = {"Mamba2ForCausalLM": "mamba2", "GraniteMoeHybridForCausalLM": "granitemoehybrid"}
# transformers 4.x spells Granite's layer types "mamba"/"attention", 5.x "linear_attention"/"full_attention"
GRANITE_LAYER = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention",
                 "full_attention": "attention"}


def model_type(raw: dict) -> str | None:
    """'mamba2', 'granitemoehybrid' or 'mamba_ssm2' (state-spaces' own Mamba-2 config: d_model, n_layer,
    ssm_cfg.layer = "Mamba2") when this config.json is one of them, else None."""
    if str((raw.get("ssm_cfg") or {}).get("layer", "")).lower() == "mamba2":
        return "mamba_ssm2"
    mt = raw.get("model_type")
    if mt in MODEL_TYPES:
        return mt
    for arch in raw.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return None


def _limit_is_default(limit) -> bool:
    if limit is None:
        return True
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ValueError(f"time_step_limit must be two numbers [min, max], found {limit!r}")
    lo, hi = (_float(v) for v in limit)
    return lo <= 0 and math.isinf(hi)


def _float(v) -> float:
    if isinstance(v, dict):                     # transformers 5.x writes {"__float__": "Infinity"}
        v = v.get("__float__", v)
    return float(v)


_NEED = object()


def _get(raw: dict, key: str, default):
    if key in raw:
        return raw[key]
    if default is _NEED:
        raise ValueError(f"lacks {key!r}, which a {raw.get('model_type')} model needs")
    return default


# Typed reads, each refusal naming its key: transformers' typed configs refuse the same values (5.x: a string where
# a bool belongs, null for an int), and an int() or bool() of them would read a damaged file as some other model.
def _int(raw: dict, key: str, default=_NEED) -> int:
    v = _get(raw, key, default)
    if isinstance(v, float) and v.is_integer():     # 2.0 from an exporter that writes every number as a float
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, found {v!r}")
    return v


def _num(raw: dict, key: str, default) -> float:
    v = _get(raw, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, found {v!r}")
    return float(v)


def _positive(raw: dict, key: str, default) -> float:
    v = _num(raw, key, default)
    if v <= 0:
        raise ValueError(f"{key} must be positive, found {v!r}")
    return v


def _flag(raw: dict, key: str, default: bool) -> bool:
    v = _get(raw, key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, found {v!r}")
    return v


def check_activation(raw: dict, where) -> None:
    """The mixer's activation: silu in every released Mamba-1, Mamba-2 and Granite-4.0-H, and the only one modelled."""
    if str(raw.get("hidden_act", "silu")) != "silu":
        raise CheckpointError(f"{where}: hidden_act={raw['hidden_act']!r}; mamba-debug supports 'silu' only")


def config_from_hf(raw: dict, where: str = "config.json") -> tuple[ModelConfig, list]:
    """(config, notes): notes say what the reference does not model (e.g. a dt clamp only HF prefill applies)."""
    mt = model_type(raw)
    notes = []
    check_activation(raw, where)
    try:
        if not _limit_is_default(raw.get("time_step_limit")):
            notes.append(f"time_step_limit={raw['time_step_limit']} is not applied (llama.cpp and HF decode ignore "
                         f"it; HF prefill clamps dt)")
        kw, keys = _mamba_ssm(raw, where) if mt == "mamba_ssm2" else _mamba2(raw, where) if mt == "mamba2" \
            else _granite(raw, where)
        check_config_values(kw, keys, where)        # before a tuple of 10^9 layer types is built
        kw.setdefault("layer_types", ("mamba2",) * kw["n_layer"])
        return ModelConfig(**kw), notes
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


# ModelConfig field -> config.json key, for the refusals of `limits.check_config_values`
_MAMBA2_KEYS = {"d_model": "hidden_size", "n_layer": "num_hidden_layers", "vocab_size": "vocab_size",
                "d_state": "state_size", "d_conv": "conv_kernel", "expand": "expand", "rms_eps": "layer_norm_epsilon"}
_MAMBA_SSM_KEYS = {"d_model": "d_model", "n_layer": "n_layer", "vocab_size": "vocab_size", "d_state": "ssm_cfg.d_state",
                   "d_conv": "ssm_cfg.d_conv", "expand": "ssm_cfg.expand", "rms_eps": "norm_epsilon"}
_GRANITE_KEYS = {"d_model": "hidden_size", "n_layer": "num_hidden_layers", "vocab_size": "vocab_size",
                 "d_state": "mamba_d_state", "d_conv": "mamba_d_conv", "expand": "mamba_expand",
                 "rms_eps": "rms_norm_eps"}


def _mamba2(raw: dict, where: str) -> tuple[dict, dict]:
    if raw.get("rms_norm", True) is False:
        raise CheckpointError(f"{where}: rms_norm=false (no gated norm) is not supported; only the gated RMSNorm "
                              f"Mamba-2 of released checkpoints")
    E, expand = _int(raw, "hidden_size"), _int(raw, "expand", 2)
    return dict(
        d_model=E, n_layer=_int(raw, "num_hidden_layers"), vocab_size=_int(raw, "vocab_size"),
        d_state=_int(raw, "state_size", 128), d_conv=_int(raw, "conv_kernel", 4), expand=expand, d_inner=expand * E,
        rms_eps=_num(raw, "layer_norm_epsilon", 1e-5), tie_embeddings=_flag(raw, "tie_word_embeddings", False),
        conv_bias=_flag(raw, "use_conv_bias", True), proj_bias=_flag(raw, "use_bias", False),
        head_dim=_int(raw, "head_dim", 64), n_heads=_int(raw, "num_heads", 128),
        n_groups=_int(raw, "n_groups", 8), chunk_size=_int(raw, "chunk_size", 256)), _MAMBA2_KEYS


def _mamba_ssm(raw: dict, where: str) -> tuple[dict, dict]:
    """mamba_ssm's MambaConfig with ssm_cfg.layer = "Mamba2" (its defaults: mamba_ssm/modules/mamba2.py)."""
    ssm = raw.get("ssm_cfg") or {}
    for key, ok in (("attn_layer_idx", lambda v: not v), ("d_intermediate", lambda v: not v),
                    ("rms_norm", lambda v: v is not False)):
        if not ok(raw.get(key)):
            raise CheckpointError(f"{where}: {key}={raw[key]!r} is not supported (mamba_ssm's own attention layers, "
                                  f"MLPs and LayerNorm models are not read yet)")
    for key, ok in (("norm_before_gate", lambda v: not v), ("rmsnorm", lambda v: v is not False),
                    ("D_has_hdim", lambda v: not v), ("d_ssm", lambda v: v is None)):
        if not ok(ssm.get(key)):
            raise CheckpointError(f"{where}: ssm_cfg.{key}={ssm[key]!r} is not supported (only the layout of the "
                                  f"released Mamba-2 checkpoints)")
    E, expand = _int(raw, "d_model"), _int(ssm, "expand", 2)
    return dict(
        d_model=E, n_layer=_int(raw, "n_layer"), vocab_size=_int(raw, "vocab_size"), d_state=_int(ssm, "d_state", 128),
        d_conv=_int(ssm, "d_conv", 4), expand=expand, d_inner=expand * E, rms_eps=_num(raw, "norm_epsilon", 1e-5),
        tie_embeddings=_flag(raw, "tie_embeddings", True), conv_bias=_flag(ssm, "conv_bias", True),
        proj_bias=_flag(ssm, "bias", False), head_dim=_int(ssm, "headdim", 64),
        n_groups=_int(ssm, "ngroups", 1), chunk_size=_int(ssm, "chunk_size", 256)), _MAMBA_SSM_KEYS


def _granite(raw: dict, where: str) -> tuple[dict, dict]:
    if raw.get("num_local_experts") and _int(raw, "num_local_experts") > 0:
        raise CheckpointError(f"{where}: num_local_experts={raw['num_local_experts']}: mixture-of-experts Granite "
                              f"checkpoints are not supported yet (dense ones, num_local_experts=0, are)")
    if raw.get("position_embedding_type") not in (None, "nope"):
        raise CheckpointError(f"{where}: position_embedding_type={raw['position_embedding_type']!r}: only "
                              f"attention without positional encoding ('nope', Granite-4.0-H) is supported")
    E, L = _int(raw, "hidden_size"), _int(raw, "num_hidden_layers")
    kinds = raw.get("layer_types") or raw.get("layers_block_type")
    if not isinstance(kinds, list) or len(kinds) != L:
        raise CheckpointError(f"{where}: layer_types must name each of the {L} layers ('mamba' or 'attention')")
    unknown = sorted({str(k) for k in kinds if not isinstance(k, str) or k not in GRANITE_LAYER})
    if unknown:
        raise CheckpointError(f"{where}: layer_types holds {unknown}; known: {sorted(GRANITE_LAYER)}")
    expand, n_heads, n_attn = _int(raw, "mamba_expand", 2), _int(raw, "mamba_n_heads", 128), \
        _int(raw, "num_attention_heads")
    auto = raw.get("mamba_d_head", "auto") in ("auto", None)        # transformers: mamba_intermediate // n_heads
    head_dim = (E * expand // n_heads if n_heads > 0 else 0) if auto else _int(raw, "mamba_d_head")
    return dict(
        d_model=E, n_layer=L, vocab_size=_int(raw, "vocab_size"), d_state=_int(raw, "mamba_d_state", 256),
        d_conv=_int(raw, "mamba_d_conv", 4), expand=expand, d_inner=expand * E,
        rms_eps=_num(raw, "rms_norm_eps", 1e-6), tie_embeddings=_flag(raw, "tie_word_embeddings", False),
        conv_bias=_flag(raw, "mamba_conv_bias", True), proj_bias=_flag(raw, "mamba_proj_bias", False),
        layer_types=tuple(GRANITE_LAYER[k] for k in kinds), head_dim=head_dim, n_heads=n_heads,
        n_groups=_int(raw, "mamba_n_groups", 1), chunk_size=_int(raw, "mamba_chunk_size", 256), n_attn_heads=n_attn,
        n_kv_heads=_int(raw, "num_key_value_heads") if raw.get("num_key_value_heads") else n_attn,
        attn_head_dim=_int(raw, "head_dim") if raw.get("head_dim") else E // max(n_attn, 1),
        attn_bias=_flag(raw, "attention_bias", False), d_ff=_int(raw, "shared_intermediate_size"),
        embedding_multiplier=_num(raw, "embedding_multiplier", 1.0),
        residual_multiplier=_num(raw, "residual_multiplier", 1.0),
        attention_multiplier=_positive(raw, "attention_multiplier", 1.0),
        logits_scaling=_positive(raw, "logits_scaling", 1.0)), _GRANITE_KEYS


def _names(cfg: ModelConfig, granite: bool) -> dict:
    """canonical name -> HF name (A and conv_w are transformed, see `params_from_hf`)."""
    root, mixer = ("model.", "mamba") if granite else ("backbone.", "mixer")
    out = {"embed": root + ("embed_tokens.weight" if granite else "embeddings.weight"),
           "norm_f": root + ("norm.weight" if granite else "norm_f.weight"), "lm_head": "lm_head.weight"}
    for i, kind in enumerate(cfg.layer_types):
        p, q = f"layers.{i}.", f"{root}layers.{i}."
        out[p + "norm"] = q + ("input_layernorm.weight" if granite else "norm.weight")
        if kind == "mamba2":
            m = f"{q}{mixer}."
            out.update({p + "in_proj": m + "in_proj.weight", p + "conv_w": m + "conv1d.weight",
                        p + "conv_b": m + "conv1d.bias", p + "dt_bias": m + "dt_bias", p + "A": m + "A_log",
                        p + "D": m + "D", p + "ssm_norm": m + "norm.weight", p + "out_proj": m + "out_proj.weight",
                        p + "in_proj_bias": m + "in_proj.bias", p + "out_proj_bias": m + "out_proj.bias"})
        else:
            a = f"{q}self_attn."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + n], out[p + n + "_bias"] = a + n + ".weight", a + n + ".bias"
        if granite:
            out.update({p + "ffn_norm": q + "post_attention_layernorm.weight",
                        p + "ffn_up": q + "shared_mlp.input_linear.weight",
                        p + "ffn_down": q + "shared_mlp.output_linear.weight"})
    return out


def tensor_names(cfg: ModelConfig, tensors: dict) -> set:
    """The transformers names this config reads from `tensors` (mamba_ssm's embedding spelling included)."""
    names = {v for k, v in _names(cfg, any(k.startswith("model.") for k in tensors)).items()
             if cfg.conv_bias or not k.endswith("conv_b")}          # else a file's conv bias is noted as ignored
    return names | {n.replace("backbone.embeddings.", "backbone.embedding.") for n in names}


def params_from_hf(cfg: ModelConfig, tensors: dict, shapes: dict, where: str = "") -> dict:
    """Canonical float64 parameters from a transformers state dict (A = -exp(A_log), conv weight squeezed,
    missing conv bias = 0, tied lm_head = embed). `shapes` is `arch.param_shapes(cfg)` (io.weights checks them)."""
    granite = any(k.startswith("model.") for k in tensors)
    names = _names(cfg, granite)
    out = {}
    for canon in shapes:
        hf = names[canon]
        if canon.endswith("conv_b") and not cfg.conv_bias:     # transformers' conv1d has none: a file's is ignored
            out[canon] = torch.zeros(shapes[canon], dtype=torch.float64)
            continue
        if hf not in tensors:
            hf_alt = hf.replace("backbone.embeddings.", "backbone.embedding.")   # mamba_ssm spelling
            if hf_alt in tensors:
                hf = hf_alt
            elif canon == "lm_head" and (cfg.tie_embeddings or "lm_head.weight" not in tensors):
                continue
            else:
                raise CheckpointError(f"{where}: missing tensor {hf} (config.json implies it); the file is incomplete "
                                      f"or config.json does not describe these weights")
        t = tensors[hf].to(torch.float64)
        if canon.endswith(".A"):
            t = -torch.exp(t)
        elif canon.endswith("conv_w"):
            t = t.reshape(t.shape[0], -1)
        out[canon] = t
    if "lm_head" not in out:
        out["lm_head"] = out["embed"]
    return out


def params_to_hf(cfg: ModelConfig, params: dict, dtype: torch.dtype = torch.float32) -> dict:
    """The inverse of `params_from_hf`: a transformers state dict for `save_pretrained`-style folders."""
    granite = cfg.d_ff > 0 or "attention" in cfg.layer_types
    names = _names(cfg, granite)
    out = {}
    for canon, t in params.items():
        if canon == "lm_head" and cfg.tie_embeddings:
            continue
        if canon.endswith(".A"):
            t = torch.log(-t)
        elif canon.endswith("conv_w"):
            t = t[:, None, :]
        out[names[canon]] = t.to(dtype).contiguous()
    return out


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json for `params_to_hf`'s state dict."""
    common = {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu"}
    if "attention" not in cfg.layer_types and cfg.d_ff == 0:
        return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", **common,
                "state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "expand": cfg.expand,
                "num_heads": cfg.n_heads, "head_dim": cfg.head_dim, "n_groups": cfg.n_groups,
                "chunk_size": cfg.chunk_size, "layer_norm_epsilon": cfg.rms_eps, "use_bias": cfg.proj_bias,
                "use_conv_bias": cfg.conv_bias}
    return {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", **common,
            "layer_types": ["mamba" if k == "mamba2" else "attention" for k in cfg.layer_types],
            "mamba_d_state": cfg.d_state, "mamba_d_conv": cfg.d_conv, "mamba_expand": cfg.expand,
            "mamba_n_heads": cfg.n_heads, "mamba_d_head": cfg.head_dim, "mamba_n_groups": cfg.n_groups,
            "mamba_chunk_size": cfg.chunk_size, "mamba_conv_bias": cfg.conv_bias, "mamba_proj_bias": cfg.proj_bias,
            "rms_norm_eps": cfg.rms_eps, "num_attention_heads": cfg.n_attn_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.attn_head_dim, "attention_bias": cfg.attn_bias,
            "shared_intermediate_size": cfg.d_ff, "num_local_experts": 0, "position_embedding_type": "nope",
            "embedding_multiplier": cfg.embedding_multiplier, "residual_multiplier": cfg.residual_multiplier,
            "attention_multiplier": cfg.attention_multiplier or cfg.attn_head_dim ** -0.5,
            "logits_scaling": cfg.logits_scaling}
