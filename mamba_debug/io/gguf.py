"""llama.cpp GGUF files of architecture `mamba` (Mamba-1): read them into a `MambaModel`, write them back.

Conventions (llama.cpp `src/models/mamba.cpp`, `convert_hf_to_gguf.py` `MambaModel`):

- metadata: `mamba.embedding_length` (E), `mamba.block_count` (L), `mamba.ssm.conv_kernel` (K),
  `mamba.ssm.inner_size` (D), `mamba.ssm.state_size` (N), `mamba.ssm.time_step_rank` (R),
  `mamba.attention.layer_norm_rms_epsilon`; the converter also writes `context_length` = 2^20,
  `feed_forward_length` = 0, `attention.head_count` = 0 and `ssm.dt_b_c_rms` = false (true = FalconMamba).
- tensors: `token_embd.weight`, `blk.N.{attn_norm.weight, ssm_in.weight, ssm_conv1d.weight,
  ssm_conv1d.bias, ssm_x.weight, ssm_dt.weight, ssm_dt.bias, ssm_a, ssm_d, ssm_out.weight}`,
  `output_norm.weight`, `output.weight` (omitted when tied: llama.cpp then reuses `token_embd`).
- a ggml shape `ne` lists the innermost dimension first, i.e. the numpy/torch shape reversed:
  `ssm_in` has ne {E, 2D} and is the torch [2D, E] matrix. `ssm_a` holds A = -exp(A_log) already;
  `ssm_conv1d` is the squeezed conv weight [D, K].
- the token list must have exactly as many entries as `token_embd` has rows: the converter pads it
  with `[PAD{i}]` tokens (type UNUSED) up to the checkpoint's padded vocabulary.

`load_gguf(path)` dequantizes every type `gguf.quants.dequantize` knows (F32, F16, BF16, Q8_0, Q4/Q5,
K-quants, ...) to float64 masters; what it could not carry over (a tokenizer it did not rebuild, unknown tensors)
is in `model.notes`. `export_gguf(model, path, dtype)` writes f32, f16, bf16 or q8_0. The vocabulary is
`gguf_vocab.py`'s. Every failure is a `CheckpointError` that names the file and the fix.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from ..arch import param_shapes
from ..config import MambaConfig
from ..errors import CheckpointError, MambaDebugError
from ..limits import check_config_values, check_weight_bytes
from ..model import MambaModel
from ..safeio import atomic_path
from .gguf_header import check_gguf_header
from .gguf_vocab import add_vocab, read_tokenizer, tokenizer_vocab
from .weights import check_params

ARCH = "mamba"
DTYPES = ("f32", "f16", "bf16", "q8_0")

# general.architecture values that are recognisably not Mamba-1, with a readable name.
OTHER_GGUF_ARCHS = {
    "mamba2": "Mamba-2", "jamba": "Jamba (hybrid attention + Mamba)", "falcon-h1": "Falcon-H1 (hybrid)",
    "nemotron_h": "Nemotron-H (hybrid)", "nemotron_h_moe": "Nemotron-H MoE (hybrid)",
    "granitehybrid": "Granite hybrid (attention + Mamba-2)", "plamo2": "PLaMo-2 (hybrid)",
    "lfm2": "LFM2 (hybrid conv + attention)", "rwkv6": "RWKV-6", "rwkv7": "RWKV-7", "rwkv6qwen2": "RWKV-6 Qwen2",
    "arwkv7": "ARWKV-7", "kimi-linear": "Kimi-Linear (hybrid)", "qwen3next": "Qwen3-Next (hybrid)",
}


def _gguf():
    try:
        import gguf  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - gguf is a declared dependency
        raise CheckpointError("reading or writing GGUF files needs the `gguf` package: pip install gguf") from exc
    return gguf


def tensor_names(n_layer: int) -> dict[str, str]:
    """canonical name (`arch.param_shapes`) -> GGUF tensor name: the one table the reader and the writer use."""
    names = {"embed": "token_embd.weight", "norm_f": "output_norm.weight", "lm_head": "output.weight"}
    for i in range(n_layer):
        c, b = f"layers.{i}.", f"blk.{i}."
        names.update({c + "norm": b + "attn_norm.weight", c + "in_proj": b + "ssm_in.weight",
                      c + "conv_w": b + "ssm_conv1d.weight", c + "conv_b": b + "ssm_conv1d.bias",
                      c + "x_proj": b + "ssm_x.weight", c + "dt_proj": b + "ssm_dt.weight",
                      c + "dt_bias": b + "ssm_dt.bias", c + "A": b + "ssm_a", c + "D": b + "ssm_d",
                      c + "out_proj": b + "ssm_out.weight"})
    return names


# =================================================================================================
# reading
# =================================================================================================
def load_gguf(path) -> MambaModel:
    """Load a llama.cpp GGUF of architecture `mamba` (Mamba-1) as a `MambaModel` with float64 masters."""
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: starts with {magic!r}, not b'GGUF'; the file is damaged or not a GGUF "
                              f"file (re-download or re-export it)")
    check_gguf_header(path)                  # counts and lengths against the file size, before the library
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the gguf library raises ValueError/IndexError/... deep inside on damaged files
        raise CheckpointError(f"{path}: cannot be parsed as GGUF ({type(exc).__name__}: {exc}); the file "
                              f"({size} bytes) is truncated or damaged: re-download or re-export it") from exc
    try:
        return _load(reader, path, size, gguf)
    finally:
        del reader


def _field(reader, key: str, path: Path, required: bool = True, kind=None):
    field = reader.get_field(key)
    if field is None:
        if required:
            raise CheckpointError(f"{path}: metadata key {key!r} is missing; the GGUF was not written by "
                                  f"llama.cpp's converter for Mamba (re-convert it with convert_hf_to_gguf.py "
                                  f"or `mamba-debug export-gguf`)")
        return None
    try:
        value = field.contents()
    except Exception as exc:
        raise CheckpointError(f"{path}: metadata key {key!r} cannot be decoded ({exc}); the file is damaged") from exc
    if kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
        raise CheckpointError(f"{path}: metadata key {key!r} should be an integer, found {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise CheckpointError(f"{path}: metadata key {key!r} should be a number, found {value!r}")
    return value


def unknown_tensors(by_name: dict, known: set, n_layer: int, count_key: str, path: Path) -> list:
    """Refuse tensors of blocks beyond the declared count (the metadata would drop them); return the other unknown
    names (a loader note)."""
    extra = sorted(set(by_name) - known)
    beyond = sorted({int(k.split(".")[1]) for k in extra if k.startswith("blk.") and k.split(".")[1].isdigit()
                     and int(k.split(".")[1]) >= n_layer})
    if beyond:
        raise CheckpointError(f"{path}: tensors of block(s) {', '.join(map(str, beyond[:5]))} but {count_key} is "
                              f"{n_layer}; the metadata does not match the tensors")
    return extra


def _load(reader, path: Path, size: int, gguf) -> MambaModel:
    arch = _field(reader, "general.architecture", path)
    if not isinstance(arch, str):
        raise CheckpointError(f"{path}: general.architecture should be a name such as 'mamba', found {arch!r}; the "
                              f"file is damaged")
    if arch != ARCH:
        kind = OTHER_GGUF_ARCHS.get(arch, f"a model of architecture {arch!r}")
        raise CheckpointError(f"{path}: general.architecture is {arch!r} ({kind}); mamba-debug reads GGUFs of "
                              f"architecture 'mamba', 'mamba2' and 'granitehybrid'; {arch!r} is not supported yet")
    if _field(reader, f"{ARCH}.ssm.dt_b_c_rms", path, required=False):
        raise CheckpointError(f"{path}: mamba.ssm.dt_b_c_rms is true, i.e. FalconMamba (Mamba-1 with RMS norms on "
                              f"dt, B and C); mamba-debug does not support FalconMamba yet")
    E = _field(reader, f"{ARCH}.embedding_length", path, kind=int)
    L = _field(reader, f"{ARCH}.block_count", path, kind=int)
    K = _field(reader, f"{ARCH}.ssm.conv_kernel", path, kind=int)
    D = _field(reader, f"{ARCH}.ssm.inner_size", path, kind=int)
    N = _field(reader, f"{ARCH}.ssm.state_size", path, kind=int)
    R = _field(reader, f"{ARCH}.ssm.time_step_rank", path, kind=int)
    eps = _field(reader, f"{ARCH}.attention.layer_norm_rms_epsilon", path, kind=float)

    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:                                  # truncation the reader itself did not notice
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes} but the "
                                  f"file has {size}; the file is truncated: re-download or re-export it")
    if "token_embd.weight" not in by_name:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing; the GGUF is incomplete "
                              f"(re-export it with `mamba-debug export-gguf` or convert_hf_to_gguf.py)")
    V = int(by_name["token_embd.weight"].shape[-1])           # ne = {E, V}
    tied = "output.weight" not in by_name
    dims = {"d_model": E, "n_layer": L, "vocab_size": V, "d_state": N, "d_conv": K, "d_inner": D, "dt_rank": R,
            "rms_eps": eps}
    check_config_values(dims, {"d_model": f"{ARCH}.embedding_length", "n_layer": f"{ARCH}.block_count",
                               "vocab_size": "token_embd.weight rows", "d_state": f"{ARCH}.ssm.state_size",
                               "d_conv": f"{ARCH}.ssm.conv_kernel", "d_inner": f"{ARCH}.ssm.inner_size",
                               "dt_rank": f"{ARCH}.ssm.time_step_rank",
                               "rms_eps": f"{ARCH}.attention.layer_norm_rms_epsilon"}, path)
    check_weight_bytes(dims, size, path, min_bits=1)
    try:
        cfg = MambaConfig(d_model=E, n_layer=L, vocab_size=V, d_state=N, d_conv=K, d_inner=D, dt_rank=R,
                          expand=D // E if E > 0 and D % E == 0 else 2, rms_eps=_short_float(eps),
                          tie_embeddings=tied, conv_bias=True, proj_bias=False)
    except ValueError as exc:
        raise CheckpointError(f"{path}: the mamba.* metadata describe an impossible model ({exc})") from exc

    names = tensor_names(L)
    shapes = param_shapes(cfg)
    missing = [names[k] for k in shapes if names[k] not in by_name and not (k == "lm_head" and tied)]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise CheckpointError(f"{path}: tensor(s) {shown} missing; the GGUF is incomplete or not a Mamba-1 model "
                              f"(re-export it with `mamba-debug export-gguf` or convert_hf_to_gguf.py)")
    params = {}
    for key, shape in shapes.items():
        if key == "lm_head" and tied:
            continue
        params[key] = _tensor(by_name[names[key]], shape, path, gguf)
    if tied:
        params["lm_head"] = params["embed"]
    for i in range(L):
        if (params[f"layers.{i}.A"] > 0).any():
            raise CheckpointError(f"{path}: blk.{i}.ssm_a holds positive values; llama.cpp stores A = -exp(A_log) "
                                  f"(all negative), so this file holds A_log or is damaged: re-convert it")
    extra = unknown_tensors(by_name, set(names.values()), L, f"{ARCH}.block_count", path)
    params = check_params(cfg, params, str(path), names)

    tokenizer, notes = read_tokenizer(reader)
    if extra:
        notes.append(f"ignored unknown tensors {', '.join(extra[:4])}")
    model = MambaModel(cfg, params, tokenizer, source=str(path), notes=notes)
    model.file_state = model.params_state()         # llama.cpp may run the file itself while these stay the same
    return model


def _short_float(x) -> float:
    """GGUF stores eps as float32 (1e-5 -> 9.99999975e-06); take the shortest decimal that rounds to it (1e-5),
    which is the value the writer meant and the same float32 llama.cpp computes with."""
    return float(str(np.float32(x)))


def _tensor(t, shape: tuple, path: Path, gguf) -> torch.Tensor:
    """Dequantize one ReaderTensor to a float64 torch tensor of the canonical (torch-order) shape."""
    qtype = gguf.GGMLQuantizationType
    tt = t.tensor_type
    np_shape = tuple(int(n) for n in reversed(t.shape.tolist()))       # ggml ne order -> numpy order
    try:
        if tt == qtype.F32:
            arr = np.asarray(t.data, dtype=np.float32)
        elif tt in (qtype.F16, qtype.F64):
            arr = np.asarray(t.data).astype(np.float64)
        elif tt in (qtype.I8, qtype.I16, qtype.I32, qtype.I64):
            raise NotImplementedError("integer tensor")
        else:
            arr = gguf.quants.dequantize(np.asarray(t.data), tt)
        arr = np.array(arr, dtype=np.float64).reshape(np_shape)
    except NotImplementedError as exc:
        raise CheckpointError(f"{path}: tensor {t.name} has type {tt.name}, which mamba-debug cannot dequantize "
                              f"({exc}); re-quantize the model to F32, F16, BF16, Q8_0 or a K-quant") from exc
    except (ValueError, TypeError, IndexError) as exc:
        raise CheckpointError(f"{path}: tensor {t.name} ({tt.name}, ne {list(map(int, t.shape))}) cannot be read "
                              f"({exc}); the file is truncated or damaged") from exc
    if arr.shape != tuple(shape):
        squeezed = [n for n in arr.shape if n != 1]
        if squeezed == [n for n in shape if n != 1]:
            arr = arr.reshape(shape)          # e.g. an unsqueezed conv1d {K, 1, D}
        else:
            raise CheckpointError(f"{path}: tensor {t.name} has ne {list(reversed(arr.shape))} (torch shape "
                                  f"{list(arr.shape)}) but the mamba.* metadata imply ne {list(reversed(shape))}; "
                                  f"the metadata and the weights disagree: re-convert the model")
    return torch.from_numpy(arr)


# =================================================================================================
# writing
# =================================================================================================
@contextlib.contextmanager
def gguf_writer(out_path, arch: str, gguf):
    """A GGUFWriter for `arch` on a unique temporary file beside `out_path` (safeio.atomic_path); what the block adds
    is written and the file renamed into place when it ends without error, else nothing is left behind."""
    with atomic_path(out_path) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        try:
            yield w
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()


def export_gguf(model: MambaModel, out_path, dtype: str = "f32") -> Path:
    """Write `model` as a GGUF of architecture `mamba` that llama.cpp loads.

    dtype applies to the big matrices (token_embd, output, ssm_in, ssm_out); norms, ssm_conv1d, ssm_x,
    ssm_dt, ssm_a, ssm_d and the biases are always F32 (as the 2024 converter did). q8_0 needs rows that
    are a multiple of 32; a matrix whose rows are not falls back to f16, like llama.cpp's converter.
    The file is written to a temporary name and renamed, so a failed export leaves nothing behind.
    """
    gguf = _gguf()
    dtype = str(dtype).lower()
    if dtype not in DTYPES:
        raise MambaDebugError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    c = model.config
    if c.proj_bias:
        raise MambaDebugError(f"{model.source or 'this model'} has in_proj/out_proj biases; llama.cpp's Mamba "
                              f"graph has no place for them, so it cannot be written as a llama.cpp GGUF")
    if c.d_inner != 2 * c.d_model:
        raise MambaDebugError(f"{model.source or 'this model'} has d_inner {c.d_inner} = {c.d_inner / c.d_model:g} x "
                              f"d_model; llama.cpp loads Mamba-1 with expand 2 only")
    q = gguf.GGMLQuantizationType
    big = {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[dtype]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    vocab = tokenizer_vocab(model) if model.tokenizer is not None else None      # refusals before any file

    out_path = Path(out_path)
    with gguf_writer(out_path, ARCH, gguf) as w:
        w.add_name(Path(model.source).name or "mamba")
        w.add_context_length(2 ** 20)               # arbitrary, as the converter writes
        w.add_embedding_length(c.d_model)
        w.add_feed_forward_length(0)                # unused, but llama.cpp reads it
        w.add_head_count(0)                         # unused, but llama.cpp reads it
        w.add_block_count(c.n_layer)
        w.add_ssm_conv_kernel(c.d_conv)
        w.add_ssm_inner_size(c.d_inner)
        w.add_ssm_state_size(c.d_state)
        w.add_ssm_time_step_rank(c.dt_rank)
        w.add_layer_norm_rms_eps(c.rms_eps)
        w.add_ssm_dt_b_c_rms(False)
        w.add_file_type(int(ftype))
        if big not in (q.F32, q.F16):
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_vocab(w, vocab, c.vocab_size)

        names = tensor_names(c.n_layer)
        for key in param_shapes(c):
            if key == "lm_head" and (c.tie_embeddings or torch.equal(model.params["lm_head"], model.params["embed"])):
                continue                             # omitted when tied; llama.cpp duplicates token_embd
            name = names[key]
            leaf = key.split(".")[-1]
            t = model.params[key].detach().to(torch.float64).cpu().numpy()
            qt = big if leaf in ("embed", "lm_head", "in_proj", "out_proj") else q.F32
            data, qt = _encode(t, qt, gguf)
            w.add_tensor(name, data, raw_dtype=qt)
    return out_path


def _encode(t: np.ndarray, qt, gguf):
    q = gguf.GGMLQuantizationType
    if qt == q.F32:
        return np.ascontiguousarray(t, dtype=np.float32), qt
    if qt == q.F16:
        return np.ascontiguousarray(t.astype(np.float32).astype(np.float16)), qt
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if t.shape[-1] % block:
        return np.ascontiguousarray(t.astype(np.float32).astype(np.float16)), q.F16
    return gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), qt), qt


def describe_gguf(path, notes=()) -> str:
    """One line per fact of a GGUF file (architecture, dimensions, tensor types, tokenizer, size); `notes`
    (the exported model's `model.notes`: what its loader did not carry over) are listed last."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    check_gguf_header(path)                  # a file that is not a GGUF, or a damaged one, named as such
    gguf = _gguf()
    reader = gguf.GGUFReader(str(path), "r")
    f = lambda k: (reader.get_field(k).contents() if reader.get_field(k) is not None else None)  # noqa: E731
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    tied = all(t.name != "output.weight" for t in reader.tensors)
    a = f("general.architecture")
    tok = f("tokenizer.ggml.model")
    n_tok = len(reader.get_field("tokenizer.ggml.tokens").data) if reader.get_field("tokenizer.ggml.tokens") else 0
    lines = [
        f"file      {path} ({path.stat().st_size / 2**20:.2f} MiB)",
        f"arch      {a}: n_layer {f(a + '.block_count')}, n_embd "
        f"{f(a + '.embedding_length')}, d_inner {f(a + '.ssm.inner_size')}, d_state {f(a + '.ssm.state_size')}, "
        f"d_conv {f(a + '.ssm.conv_kernel')}, "
        + (f"heads {f(a + '.ssm.time_step_rank')}, groups {f(a + '.ssm.group_count')}, " if a == "mamba2" else
           f"dt_rank {f(a + '.ssm.time_step_rank')}, ")
        + f"rms_eps {f(a + '.attention.layer_norm_rms_epsilon'):g}",
        f"tensors   {len(reader.tensors)}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + (" (output tied to token_embd)" if tied else ""),
        f"tokenizer {tok}" + (f", {n_tok} tokens, pre {f('tokenizer.ggml.pre')!r}, "
                              f"bos {f('tokenizer.ggml.bos_token_id')}, eos {f('tokenizer.ggml.eos_token_id')}"
                              if tok == "gpt2" else
                              f", vocab_size {f(a + '.vocab_size')} (no tokenizer in the model)"),
    ]
    lines += [f"note      {n}" for n in notes]
    del reader
    return "\n".join(lines)
