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
    lo, hi = (_float(v) for v in limit)
    return lo <= 0 and math.isinf(hi)


def _float(v) -> float:
    if isinstance(v, dict):                     # transformers 5.x writes {"__float__": "Infinity"}
        v = v.get("__float__", v)
    return float(v)


def _need(raw: dict, key: str, where: str):
    if key not in raw:
        raise CheckpointError(f"{where}: config.json lacks {key!r}, which a {raw.get('model_type')} model needs")
    return raw[key]


def config_from_hf(raw: dict, where: str = "config.json") -> tuple[ModelConfig, list]:
    """(config, notes): notes say what the reference does not model (e.g. a dt clamp only HF prefill applies)."""
    mt = model_type(raw)
    notes = []
    if str(raw.get("hidden_act", "silu")) != "silu":
        raise CheckpointError(f"{where}: hidden_act={raw['hidden_act']!r}; mamba-debug supports 'silu' only")
    if not _limit_is_default(raw.get("time_step_limit")):
        notes.append(f"time_step_limit={raw['time_step_limit']} is not applied (llama.cpp and HF decode ignore it; "
                     f"HF prefill clamps dt)")
    try:
        if mt == "mamba_ssm2":
            return _mamba_ssm(raw, where), notes
        E = int(_need(raw, "hidden_size", where))
        if mt == "mamba2":
            return _mamba2(raw, E, where), notes
        return _granite(raw, E, where), notes
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def _mamba2(raw: dict, E: int, where: str) -> ModelConfig:
    if raw.get("rms_norm", True) is False:
        raise CheckpointError(f"{where}: rms_norm=false (no gated norm) is not supported; only the gated RMSNorm "
                              f"Mamba-2 of released checkpoints")
    d_inner = int(float(raw.get("expand", 2)) * E)
    L = int(_need(raw, "num_hidden_layers", where))
    return ModelConfig(
        d_model=E, n_layer=L, vocab_size=int(_need(raw, "vocab_size", where)),
        d_state=int(raw.get("state_size", 128)), d_conv=int(raw.get("conv_kernel", 4)),
        expand=int(raw.get("expand", 2)), d_inner=d_inner, rms_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), conv_bias=bool(raw.get("use_conv_bias", True)),
        proj_bias=bool(raw.get("use_bias", False)), layer_types=("mamba2",) * L,
        head_dim=int(raw.get("head_dim", 64)), n_heads=int(raw.get("num_heads", 128)),
        n_groups=int(raw.get("n_groups", 8)), chunk_size=int(raw.get("chunk_size", 256)))


def _mamba_ssm(raw: dict, where: str) -> ModelConfig:
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
    E, L = int(_need(raw, "d_model", where)), int(_need(raw, "n_layer", where))
    expand = int(ssm.get("expand", 2))
    return ModelConfig(
        d_model=E, n_layer=L, vocab_size=int(_need(raw, "vocab_size", where)), d_state=int(ssm.get("d_state", 128)),
        d_conv=int(ssm.get("d_conv", 4)), expand=expand, d_inner=expand * E, rms_eps=float(raw.get("norm_epsilon", 1e-5)),
        tie_embeddings=bool(raw.get("tie_embeddings", True)), conv_bias=bool(ssm.get("conv_bias", True)),
        proj_bias=bool(ssm.get("bias", False)), layer_types=("mamba2",) * L, head_dim=int(ssm.get("headdim", 64)),
        n_groups=int(ssm.get("ngroups", 1)), chunk_size=int(ssm.get("chunk_size", 256)))


def _granite(raw: dict, E: int, where: str) -> ModelConfig:
    if int(raw.get("num_local_experts") or 0) > 0:
        raise CheckpointError(f"{where}: num_local_experts={raw['num_local_experts']}: mixture-of-experts Granite "
                              f"checkpoints are not supported yet (dense ones, num_local_experts=0, are)")
    if raw.get("position_embedding_type") not in (None, "nope"):
        raise CheckpointError(f"{where}: position_embedding_type={raw['position_embedding_type']!r}: only "
                              f"attention without positional encoding ('nope', Granite-4.0-H) is supported")
    L = int(_need(raw, "num_hidden_layers", where))
    kinds = raw.get("layer_types") or raw.get("layers_block_type")
    if kinds is None or len(kinds) != L:
        raise CheckpointError(f"{where}: layer_types must name each of the {L} layers ('mamba' or 'attention')")
    unknown = sorted({k for k in kinds if k not in GRANITE_LAYER})
    if unknown:
        raise CheckpointError(f"{where}: layer_types holds {unknown}; known: {sorted(GRANITE_LAYER)}")
    expand = raw.get("mamba_expand", 2)
    d_inner = int(expand * E)
    n_heads = int(raw.get("mamba_n_heads", 128))
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = d_inner // n_heads if head_dim in ("auto", None) else int(head_dim)
    n_attn = int(_need(raw, "num_attention_heads", where))
    return ModelConfig(
        d_model=E, n_layer=L, vocab_size=int(_need(raw, "vocab_size", where)),
        d_state=int(raw.get("mamba_d_state", 256)), d_conv=int(raw.get("mamba_d_conv", 4)), expand=int(expand),
        d_inner=d_inner, rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)), layer_types=tuple(GRANITE_LAYER[k] for k in kinds),
        head_dim=head_dim, n_heads=n_heads, n_groups=int(raw.get("mamba_n_groups", 1)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)), n_attn_heads=n_attn,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_attn),
        attn_head_dim=int(raw.get("head_dim") or E // n_attn), attn_bias=bool(raw.get("attention_bias", False)),
        d_ff=int(_need(raw, "shared_intermediate_size", where)),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)))


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


def params_from_hf(cfg: ModelConfig, tensors: dict, shapes: dict, where: str = "") -> dict:
    """Canonical float64 parameters from a transformers state dict (A = -exp(A_log), conv weight squeezed,
    missing conv bias = 0, tied lm_head = embed). `shapes` is `arch.param_shapes(cfg)` (io.weights checks them)."""
    granite = any(k.startswith("model.") for k in tensors)
    names = _names(cfg, granite)
    out = {}
    for canon in shapes:
        hf = names[canon]
        if hf not in tensors:
            hf_alt = hf.replace("backbone.embeddings.", "backbone.embedding.")   # mamba_ssm spelling
            if hf_alt in tensors:
                hf = hf_alt
            elif canon == "lm_head" and (cfg.tie_embeddings or "lm_head.weight" not in tensors):
                continue
            elif canon.endswith("conv_b") and not cfg.conv_bias:
                out[canon] = torch.zeros(shapes[canon], dtype=torch.float64)
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
