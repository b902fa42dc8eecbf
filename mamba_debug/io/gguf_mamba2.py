"""llama.cpp GGUF files of architectures `mamba2` (Mamba2ForCausalLM) and `granitehybrid` (Granite-4.0-H dense):
written and read; `export_gguf` and `load_gguf` here dispatch on the architecture (Mamba-1 goes to `io.gguf`).

Conventions (llama.cpp `src/models/mamba2.cpp`, `conversion/mamba.py::Mamba2Model`; research/mamba2.md §2.3, §6.3):

- metadata `mamba2.{context_length, embedding_length, block_count, ssm.conv_kernel, ssm.inner_size, ssm.state_size,
  ssm.time_step_rank (= H), ssm.group_count, attention.layer_norm_rms_epsilon}`; no tokenizer: `tokenizer.ggml.model`
  "none" and `mamba2.vocab_size`.
- tensors `token_embd.weight`, `output_norm.weight`, `output.weight` (absent when tied), `blk.i.{attn_norm.weight,
  ssm_in.weight, ssm_conv1d.weight [conv_dim, K], ssm_conv1d.bias, ssm_dt.bias [H], ssm_a (H, 1) = -exp(A_log),
  ssm_d (H, 1), ssm_norm.weight (G, D/G), ssm_out.weight}` (numpy shapes; ggml ne is the reverse).

`granitehybrid` (llama.cpp `granite-hybrid.cpp`, `conversion/granite.py`): the same ssm tensors on Mamba-2 layers,
`attn_q/k/v/output.weight` on attention layers, `ffn_norm`, `ffn_gate`, `ffn_up` (the halves of the shared MLP's
input_linear), `ffn_down` on every layer; `attention.head_count_kv` is a per-layer array (0 = a Mamba-2 layer),
`embedding_scale`, `residual_scale`, `attention.scale`, `logit_scale`, `rope.scaling.finetuned` false (no RoPE),
`expert_count` 0, `feed_forward_length` = `expert_shared_feed_forward_length` = F.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..arch import param_shapes
from ..config import ModelConfig
from ..errors import CheckpointError, MambaDebugError
from ..limits import check_config_values
from ..model import MambaModel, require_model
from . import gguf as gguf1
from .gguf_header import check_gguf_header
from .gguf_vocab import add_vocab, read_tokenizer, tokenizer_vocab
from .weights import check_params

ARCH, HYBRID = "mamba2", "granitehybrid"
LAYER = {"norm": "attn_norm.weight", "in_proj": "ssm_in.weight", "conv_w": "ssm_conv1d.weight",
         "conv_b": "ssm_conv1d.bias", "dt_bias": "ssm_dt.bias", "A": "ssm_a", "D": "ssm_d",
         "ssm_norm": "ssm_norm.weight", "out_proj": "ssm_out.weight"}
ATTN = {"norm": "attn_norm.weight", "q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
        "o_proj": "attn_output.weight"}
FFN = {"ffn_norm": "ffn_norm.weight", "ffn_down": "ffn_down.weight"}      # ffn_up -> ffn_gate + ffn_up halves


def tensor_names(cfg: ModelConfig) -> dict:
    names = {"embed": "token_embd.weight", "norm_f": "output_norm.weight", "lm_head": "output.weight"}
    for i, kind in enumerate(cfg.layer_types):
        table = {**(LAYER if kind == "mamba2" else ATTN), **(FFN if cfg.d_ff else {})}
        names.update({f"layers.{i}.{k}": f"blk.{i}.{v}" for k, v in table.items()})
        if cfg.d_ff:
            names[f"layers.{i}.ffn_up"] = f"blk.{i}.ffn_gate.weight+blk.{i}.ffn_up.weight"
    return names


def _file_shape(key: str, shape: tuple, cfg: ModelConfig) -> tuple:
    leaf = key.split(".")[-1]
    if leaf in ("A", "D"):
        return (shape[0], 1)
    if leaf == "ssm_norm":
        return (cfg.n_groups, cfg.d_inner // cfg.n_groups)
    return shape


# -- writing ----------------------------------------------------------------------------------------
def export_gguf(model: MambaModel, out_path, dtype: str = "f32") -> Path:
    """Write `model` as a llama.cpp GGUF: `mamba` (Mamba-1, io.gguf) or `mamba2`."""
    require_model(model, "export_gguf")
    c = model.config
    if set(c.layer_types) == {"mamba1"}:
        return gguf1.export_gguf(model, out_path, dtype)
    hybrid = "attention" in c.layer_types or c.d_ff > 0
    if hybrid and c.d_inner != 2 * c.d_model:       # granite-hybrid.cpp: GGML_ASSERT(2 * n_embd == d_inner)
        raise MambaDebugError(f"{model.source or 'this model'} has d_inner {c.d_inner} = {c.d_inner / c.d_model:g} x "
                              f"d_model; llama.cpp's granitehybrid graph supports expand 2 only (it aborts loading "
                              f"anything else), so it cannot be written as a llama.cpp GGUF")
    if hybrid and "attention" not in c.layer_types:  # llama-memory-hybrid: an empty KV cache fails GGML_ASSERT(buffer)
        raise MambaDebugError(f"{model.source or 'this model'} is a hybrid with no attention layer; llama.cpp's "
                              f"granitehybrid graph then allocates an empty KV cache and aborts, so it cannot be "
                              f"written as a llama.cpp GGUF")
    if c.proj_bias or c.attn_bias or c.mlp_bias:
        raise MambaDebugError(f"{model.source or 'this model'} has projection biases; llama.cpp's Mamba-2 / "
                              f"granitehybrid graphs have no place for them")
    gguf = gguf1._gguf()
    dtype = str(dtype).lower()
    if dtype not in gguf1.DTYPES:
        raise MambaDebugError(f"--dtype must be one of {', '.join(gguf1.DTYPES)}, got {dtype!r}")
    q = gguf.GGMLQuantizationType
    big = {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[dtype]
    vocab = tokenizer_vocab(model) if model.tokenizer is not None else None
    out_path = Path(out_path)
    with gguf1.gguf_writer(out_path, HYBRID if hybrid else ARCH, gguf) as w:
        w.add_name(Path(model.source).name or "mamba2")
        w.add_context_length(2 ** 20)
        w.add_embedding_length(c.d_model)
        w.add_block_count(c.n_layer)
        if hybrid:
            _add_hybrid_keys(w, c)
        else:
            w.add_feed_forward_length(0)
            w.add_head_count(0)
        w.add_ssm_conv_kernel(c.d_conv)
        w.add_ssm_inner_size(c.d_inner)
        w.add_ssm_state_size(c.d_state)
        w.add_ssm_time_step_rank(c.n_heads)
        w.add_ssm_group_count(c.n_groups)
        w.add_layer_norm_rms_eps(c.rms_eps)
        w.add_file_type(int({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]))
        if big not in (q.F32, q.F16):
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_vocab(w, vocab, c.vocab_size)
        names = tensor_names(c)
        for key, shape in param_shapes(c).items():
            if key == "lm_head" and (c.tie_embeddings or torch.equal(model.params["lm_head"], model.params["embed"])):
                continue
            t = model.params[key].detach().to(torch.float64).cpu().numpy().reshape(_file_shape(key, shape, c))
            qt = q.F32 if t.ndim == 1 or key.split(".")[-1] in ("conv_w", "A", "D", "ssm_norm") else big
            parts = names[key].split("+")
            for name, part in zip(parts, np.split(t, len(parts), axis=0)):     # ffn_up: gate rows, then up rows
                data, pqt = gguf1._encode(part, qt, gguf)
                w.add_tensor(name, data, raw_dtype=pqt)
    return out_path


def _add_hybrid_keys(w, c: ModelConfig):
    a = HYBRID
    w.add_feed_forward_length(c.d_ff)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", c.d_ff)
    w.add_expert_count(0)
    w.add_expert_used_count(0)
    w.add_head_count(c.n_attn_heads)
    w.add_head_count_kv([c.n_kv_heads if k == "attention" else 0 for k in c.layer_types])
    w.add_key_length(c.attn_head_dim)
    w.add_value_length(c.attn_head_dim)
    w.add_rope_dimension_count(c.attn_head_dim)
    w.add_bool(f"{a}.rope.scaling.finetuned", False)             # Granite-4.0-H: no positional encoding
    w.add_float32(f"{a}.embedding_scale", c.embedding_multiplier)
    w.add_float32(f"{a}.residual_scale", c.residual_multiplier)
    w.add_float32(f"{a}.attention.scale", c.attention_multiplier or c.attn_head_dim ** -0.5)
    w.add_float32(f"{a}.logit_scale", c.logits_scaling)


# -- reading ----------------------------------------------------------------------------------------
def load_gguf(path) -> MambaModel:
    """Load a GGUF of architecture `mamba` (io.gguf), `mamba2` or `granitehybrid` (dense)."""
    gguf = gguf1._gguf()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as fh:
        if fh.read(4) == b"GGUF":           # (else io.gguf says what the file starts with)
            check_gguf_header(path)         # before the library allocates what a damaged header declares
    try:
        reader = gguf.GGUFReader(str(path), "r")
        arch = reader.get_field("general.architecture")
        arch = arch.contents() if arch is not None else None
    except Exception:  # noqa: BLE001 - io.gguf names the damage precisely
        arch = None
    if arch not in (ARCH, HYBRID):
        return gguf1.load_gguf(path)
    try:
        return _load(reader, arch, path, path.stat().st_size, gguf)
    finally:
        del reader


def _kv_heads(kv, n_layer: int, key: str, path: Path) -> list:
    """KV heads of each layer (0: a Mamba-2 layer), from one count or a per-layer array."""
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n_layer
    if len(kv) != n_layer or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in kv):
        raise CheckpointError(f"{path}: {key} should be a count of KV heads, or one per layer ({n_layer}), each 0 for "
                              f"a Mamba-2 layer; found {kv!r}")
    return kv


def _finite(f, a: str, key: str, path: Path, at_least: float = -math.inf, above: float = -math.inf) -> float:
    v = f(key, float)
    if not (math.isfinite(v) and v >= at_least and v > above):
        bound = f" and above {above:g}" if above > -math.inf else f" and at least {at_least:g}" \
            if at_least > -math.inf else ""
        raise CheckpointError(f"{path}: {a}.{key} = {v!r} should be a finite number{bound}; the file is damaged")
    return v


def _load(reader, a: str, path: Path, size: int, gguf) -> MambaModel:
    def f(key, kind=int, required=True):
        return gguf1._field(reader, f"{a}.{key}", path, required=required, kind=kind)
    E, L, K, D, N = (f(k) for k in ("embedding_length", "block_count", "ssm.conv_kernel", "ssm.inner_size",
                                     "ssm.state_size"))
    H, G, eps = f("ssm.time_step_rank"), f("ssm.group_count"), f("attention.layer_norm_rms_epsilon", float)
    keys = {"d_model": "embedding_length", "n_layer": "block_count", "d_conv": "ssm.conv_kernel",
            "d_inner": "ssm.inner_size", "d_state": "ssm.state_size", "rms_eps": "attention.layer_norm_rms_epsilon"}
    check_config_values({"d_model": E, "n_layer": L, "d_conv": K, "d_inner": D, "d_state": N, "rms_eps": eps},
                        {k: f"{a}.{v}" for k, v in keys.items()}, path)     # before tables of what they declare
    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes} but the "
                                  f"file has {size}; the file is truncated: re-download or re-export it")
    if "token_embd.weight" not in by_name:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing; the GGUF is incomplete")
    V = int(by_name["token_embd.weight"].shape[-1])
    tied = "output.weight" not in by_name
    kw = dict(layer_types=("mamba2",) * L)
    if a == HYBRID:
        if (f("expert_count", required=False) or 0) > 0:
            raise CheckpointError(f"{path}: {a}.expert_count > 0: mixture-of-experts Granite GGUFs are not "
                                  f"supported yet (dense ones are)")
        if f("rope.scaling.finetuned", kind=None, required=False):
            raise CheckpointError(f"{path}: {a}.rope.scaling.finetuned is true (RoPE attention, Bamba-style); "
                                  f"only attention without positional encoding (Granite-4.0-H) is supported")
        kv = _kv_heads(f("attention.head_count_kv", kind=None), L, f"{a}.attention.head_count_kv", path)
        Ha, d_ff = f("attention.head_count"), f("feed_forward_length")
        if Ha < 1 or d_ff < 1:          # the head size divides by the one, and every layer has an FFN of the other
            raise CheckpointError(f"{path}: {a}.attention.head_count and {a}.feed_forward_length must be at least 1, "
                                  f"found {Ha} and {d_ff}; the file is damaged")
        kw = dict(layer_types=tuple("attention" if n else "mamba2" for n in kv), n_attn_heads=Ha,
                  n_kv_heads=max(kv) or Ha, attn_head_dim=f("attention.key_length", required=False) or E // Ha,
                  d_ff=d_ff, embedding_multiplier=_finite(f, a, "embedding_scale", path),
                  residual_multiplier=_finite(f, a, "residual_scale", path),
                  attention_multiplier=_finite(f, a, "attention.scale", path, at_least=0.0),   # 0: 1/sqrt(head size)
                  logits_scaling=_finite(f, a, "logit_scale", path, above=0.0))
    try:
        cfg = ModelConfig(d_model=E, n_layer=L, vocab_size=V, d_state=N, d_conv=K, d_inner=D,
                          expand=D // E if D % E == 0 else 2, rms_eps=gguf1._short_float(eps), tie_embeddings=tied,
                          n_heads=H, head_dim=D // H if H and D % H == 0 else 0, n_groups=G, **kw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: the {a}.* metadata describe an impossible model ({exc})") from exc
    for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        setattr(cfg, k, gguf1._short_float(getattr(cfg, k)))      # stored as float32: 0.3 reads as 0.3
    names = tensor_names(cfg)
    extra = gguf1.unknown_tensors(by_name, {n for v in names.values() for n in v.split("+")}, L, f"{a}.block_count",
                                  path)
    shapes = param_shapes(cfg)
    missing = [n for k in shapes for n in names[k].split("+") if n not in by_name and not (k == "lm_head" and tied)]
    if missing:
        raise CheckpointError(f"{path}: tensor(s) {', '.join(missing[:6])} missing; the GGUF is incomplete")
    params = {}
    for key, shape in shapes.items():
        if key == "lm_head" and tied:
            continue
        parts = names[key].split("+")
        fshape = _file_shape(key, shape, cfg)
        fshape = (fshape[0] // len(parts),) + tuple(fshape[1:])
        params[key] = torch.cat([gguf1._tensor(by_name[n], fshape, path, gguf) for n in parts]).reshape(shape)
    if tied:
        params["lm_head"] = params["embed"]
    params = check_params(cfg, params, str(path), names)
    tokenizer, notes = read_tokenizer(reader)
    if extra:
        notes.append(f"ignored unknown tensors {', '.join(extra[:4])}")
    model = MambaModel(cfg, params, tokenizer, source=str(path), notes=notes)
    model.file_state = model.params_state()         # llama.cpp may run the file itself while these stay the same
    return model


__all__ = ["export_gguf", "load_gguf", "tensor_names"]
