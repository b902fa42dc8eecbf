"""Config values in range and sizes within sane limits, checked before any memory is spent on them.

`check_config_values(values, keys, source)`: the values a reader is about to build a `ModelConfig` from (field ->
value), with the file's name of each field (field -> key) so a refusal names the key as the user sees it.
`check_weight_bytes(cfg, file_bytes, source)`: the parameters the config implies must fit in the weight files
(at least one byte per element), so a header that declares 10^7 layers is refused before a table of them is built.
"""
from __future__ import annotations

import math

from .errors import CheckpointError

# Far beyond any released Mamba (the biggest: 64 layers, d_model 4096, vocab ~256k), small enough to refuse nonsense.
LIMITS = {"d_model": 1 << 16, "n_layer": 1 << 12, "vocab_size": 1 << 24, "d_state": 1 << 12, "d_conv": 1 << 8,
          "expand": 64, "d_inner": 1 << 18, "dt_rank": 1 << 16}
EPS_RANGE = (0.0, 1.0)          # the norm's eps: finite, > 0, and below 1 (released models use 1e-5 or 1e-6)


def check_config_values(values: dict, keys: dict, source) -> None:
    for field, limit in LIMITS.items():
        if field not in values or values[field] in (None, "auto") or (field in ("d_inner", "dt_rank")
                                                                       and values[field] == 0):
            continue
        v = values[field]
        if isinstance(v, bool) or not isinstance(v, int):
            raise CheckpointError(f"{source}: {keys.get(field, field)} must be an integer, found {v!r}")
        if not 1 <= v <= limit:
            raise CheckpointError(f"{source}: {keys.get(field, field)} = {v} is out of range (1..{limit}); the "
                                  f"config is damaged")
    for field in ("tie_embeddings", "conv_bias", "proj_bias"):
        if field in values and not isinstance(values[field], bool):     # bool("false") is True
            raise CheckpointError(f"{source}: {keys.get(field, field)} must be true or false, found {values[field]!r}")
    if "rms_eps" in values:
        eps = values["rms_eps"]
        ok = isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps)
        if not ok or not EPS_RANGE[0] < eps < EPS_RANGE[1]:
            raise CheckpointError(f"{source}: {keys.get('rms_eps', 'rms_eps')} = {eps!r}: the norm's epsilon must be "
                                  f"a finite number in ({EPS_RANGE[0]:g}, {EPS_RANGE[1]:g}), e.g. 1e-5; fix the config")


def n_param_elements(values: dict) -> int:
    """Elements of a Mamba-1 model of these (already range-checked) dimensions, without building any table."""
    E, L, V = values["d_model"], values["n_layer"], values["vocab_size"]
    N, K = values.get("d_state") or 16, values.get("d_conv") or 4
    D = values.get("d_inner") or (values.get("expand") or 2) * E
    R = values.get("dt_rank")
    R = math.ceil(E / 16) if R in (None, "auto", 0) else R
    per_layer = E + 2 * D * E + D * K + D + (R + 2 * N) * D + D * R + D + D * N + D + E * D
    return L * per_layer + V * E + E


def check_weight_bytes(values: dict, file_bytes: int, source, min_bits: int = 8) -> None:
    """min_bits: the fewest bits per element the format can store (safetensors 8; GGUF's quants down to ~1.5)."""
    need = n_param_elements(values)
    if need * min_bits > file_bytes * 8:
        raise CheckpointError(f"{source}: the config declares {need:,} weight elements but the weight files hold "
                              f"{file_bytes:,} bytes (at least {min_bits} bit(s) per element); the config does not "
                              f"belong to these weights or the files are truncated")
