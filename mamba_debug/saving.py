"""Write a model as a transformers `MambaForCausalLM` folder (config.json + model.safetensors [+ tokenizer.json])."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .model import MambaModel


def save_hf(model: MambaModel, folder, dtype: torch.dtype = torch.float32) -> Path:
    from safetensors.torch import save_file  # noqa: PLC0415

    c, folder = model.config, Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"backbone.embeddings.weight": model.params["embed"], "backbone.norm_f.weight": model.params["norm_f"]}
    if not c.tie_embeddings:
        tensors["lm_head.weight"] = model.params["lm_head"]
    for i in range(c.n_layer):
        p, f = model.params, f"backbone.layers.{i}."
        m = f + "mixer."
        g = lambda k: p[f"layers.{i}.{k}"]  # noqa: E731
        tensors.update({f + "norm.weight": g("norm"), m + "in_proj.weight": g("in_proj"),
                        m + "conv1d.weight": g("conv_w")[:, None, :], m + "conv1d.bias": g("conv_b"),
                        m + "x_proj.weight": g("x_proj"), m + "dt_proj.weight": g("dt_proj"),
                        m + "dt_proj.bias": g("dt_bias"), m + "A_log": torch.log(-g("A")), m + "D": g("D"),
                        m + "out_proj.weight": g("out_proj")})
        if c.proj_bias:
            tensors[m + "in_proj.bias"] = g("in_proj_bias")
            tensors[m + "out_proj.bias"] = g("out_proj_bias")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": c.d_model,
              "num_hidden_layers": c.n_layer, "vocab_size": c.vocab_size, "state_size": c.d_state,
              "conv_kernel": c.d_conv, "expand": c.expand, "intermediate_size": c.d_inner,
              "time_step_rank": c.dt_rank, "layer_norm_epsilon": c.rms_eps, "tie_word_embeddings": c.tie_embeddings,
              "use_conv_bias": c.conv_bias, "use_bias": c.proj_bias, "residual_in_fp32": True}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save(str(folder / "tokenizer.json"))
    return folder
