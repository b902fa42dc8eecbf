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
K-quants, ...) to float64 masters; `export_gguf(model, path, dtype)` writes f32, f16, bf16 or q8_0.
Every failure is a `CheckpointError` that names the file and the fix.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from .config import MambaConfig
from .errors import CheckpointError, MambaDebugError
from .model import MambaModel
from .weights import check_params, expected_shapes

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

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer is the GPT-2 regex (= tokenizers' ByteLevel regex)
GPT2_REGEX_PRES = {"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                   "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling"}
# ... and those with the Llama-3 regex (llama.cpp also sets ignore_merges for most of them)
LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
               "jina-v5-nano", "dbrx", "smaug"}
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def _gguf():
    try:
        import gguf  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - gguf is a declared dependency
        raise CheckpointError("reading or writing GGUF files needs the `gguf` package: pip install gguf") from exc
    return gguf


def tensor_names(n_layer: int) -> dict[str, str]:
    """canonical name (weights.py) -> GGUF tensor name."""
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


def _load(reader, path: Path, size: int, gguf) -> MambaModel:
    arch = _field(reader, "general.architecture", path)
    if arch != ARCH:
        kind = OTHER_GGUF_ARCHS.get(arch, f"a model of architecture {arch!r}")
        raise CheckpointError(f"{path}: general.architecture is {arch!r} ({kind}); mamba-debug reads Mamba-1 GGUFs "
                              f"(architecture 'mamba') only, {arch!r} is not supported yet")
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
    try:
        cfg = MambaConfig(d_model=E, n_layer=L, vocab_size=V, d_state=N, d_conv=K, d_inner=D, dt_rank=R,
                          expand=D // E if E > 0 and D % E == 0 else 2, rms_eps=_short_float(eps),
                          tie_embeddings=tied, conv_bias=True, proj_bias=False)
    except ValueError as exc:
        raise CheckpointError(f"{path}: the mamba.* metadata describe an impossible model ({exc})") from exc

    names = tensor_names(L)
    shapes = expected_shapes(cfg)
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
    known = set(names.values())
    extra = sorted(set(by_name) - known)
    params = check_params(cfg, params, str(path), names)

    tokenizer, note = _read_tokenizer(reader, V)
    source = str(path)
    notes = [n for n in (note, f"ignored unknown tensors {', '.join(extra[:4])}" if extra else None) if n]
    if notes:
        source += " [" + "; ".join(notes) + "]"
    return MambaModel(cfg, params, tokenizer, source=source)


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


# -- tokenizer ------------------------------------------------------------------------------------
def _read_tokenizer(reader, n_vocab: int):
    """(tokenizers.Tokenizer | None, note | None) from tokenizer.ggml.* metadata."""
    model = reader.get_field("tokenizer.ggml.model")
    if model is None:
        return None, "no tokenizer in the GGUF"
    try:
        model = model.contents()
        if model in ("none", "no_vocab"):
            return None, "no tokenizer in the GGUF (tokenizer.ggml.model = none)"
        if model != "gpt2":
            return None, f"tokenizer.ggml.model {model!r} is not rebuilt (only gpt2-style byte-level BPE is)"
        tokens = reader.get_field("tokenizer.ggml.tokens").contents()
        merges_f = reader.get_field("tokenizer.ggml.merges")
        if merges_f is None:
            return None, "gpt2 tokenizer without merges is not rebuilt"
        merges = merges_f.contents()
        types_f = reader.get_field("tokenizer.ggml.token_type")
        types = types_f.contents() if types_f is not None else [TOKEN_NORMAL] * len(tokens)
        pre_f = reader.get_field("tokenizer.ggml.pre")
        pre = pre_f.contents() if pre_f is not None else "default"
    except Exception as exc:  # noqa: BLE001 - a damaged tokenizer must not stop the weights from loading
        return None, f"tokenizer metadata unreadable ({type(exc).__name__}: {exc})"
    try:
        return build_bpe_tokenizer(tokens, merges, types, pre)
    except Exception as exc:  # noqa: BLE001
        return None, f"the gpt2 tokenizer could not be rebuilt ({type(exc).__name__}: {exc})"


def build_bpe_tokenizer(tokens: list[str], merges: list[str], types: list[int], pre: str):
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp's gpt2-style token list and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs, dropped = [], 0
    for m in merges:
        pos = m.find(" ", 1)                                # llama.cpp splits at the first space after index 0
        if pos > 0:
            a, b = m[:pos], m[pos + 1:]
            if a in vocab and b in vocab and a + b in vocab:
                pairs.append((a, b))
            else:                                           # e.g. a vocabulary cut to the model's rows
                dropped += 1
    notes = [f"{dropped} of {len(merges)} merges dropped (their tokens are not in the vocabulary)"] if dropped else []
    kwargs = {}
    if pre in LLAMA3_PRES:
        kwargs["ignore_merges"] = True
    bpe = models.BPE(vocab=vocab, merges=pairs, **kwargs)
    tok = Tokenizer(bpe)
    if pre in LLAMA3_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre not in GPT2_REGEX_PRES:
            notes.append(f"tokenizer pre-type {pre!r} approximated by the GPT-2 regex; text may split differently "
                         f"from llama.cpp (token ids given directly are unaffected)")
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == TOKEN_CONTROL and vocab.get(tokens[i]) == i]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TOKEN_USER_DEFINED and vocab.get(tokens[i]) == i]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok, "; ".join(notes) or None


# =================================================================================================
# writing
# =================================================================================================
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
    vocab = _tokenizer_vocab(model) if model.tokenizer is not None else None

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        w.add_name(Path(str(model.source).split(" [")[0]).name or "mamba")
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
        if vocab is None:
            w.add_tokenizer_model("none")
            w.add_vocab_size(c.vocab_size)
        else:
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(vocab["pre"])
            w.add_token_list(vocab["tokens"])
            w.add_token_types(vocab["types"])
            w.add_token_merges(vocab["merges"])
            for key, adder in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                               ("pad", w.add_pad_token_id), ("unk", w.add_unk_token_id)):
                if vocab.get(key) is not None:
                    adder(vocab[key])
            w.add_add_bos_token(False)
            w.add_add_eos_token(False)

        names = tensor_names(c.n_layer)
        for key in expected_shapes(c):
            if key == "lm_head" and (c.tie_embeddings or torch.equal(model.params["lm_head"], model.params["embed"])):
                continue                             # omitted when tied; llama.cpp duplicates token_embd
            name = names[key]
            leaf = key.split(".")[-1]
            t = model.params[key].detach().to(torch.float64).cpu().numpy()
            qt = big if leaf in ("embed", "lm_head", "in_proj", "out_proj") else q.F32
            data, qt = _encode(t, qt, gguf)
            w.add_tensor(name, data, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    except BaseException:
        try:
            w.close()
        except Exception:  # noqa: BLE001
            pass
        tmp.unlink(missing_ok=True)
        raise
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


def _tokenizer_vocab(model: MambaModel) -> dict:
    """gpt2-style token list / types / merges / special ids from a byte-level BPE `tokenizers.Tokenizer`."""
    tok = model.tokenizer
    where = model.source or "this model"
    try:
        j = json.loads(tok.to_str())
    except Exception as exc:
        raise MambaDebugError(f"{where}: the tokenizer cannot be serialised ({exc})") from exc
    m = j.get("model") or {}
    if m.get("type") != "BPE" or not _is_byte_level(j.get("pre_tokenizer")):
        raise MambaDebugError(f"{where}: the tokenizer is {m.get('type')} with pre-tokenizer "
                              f"{(j.get('pre_tokenizer') or {}).get('type')}; llama.cpp's gpt2 tokenizer needs a "
                              f"byte-level BPE. Drop the tokenizer (model.tokenizer = None) to export the weights "
                              f"alone")
    id_to_tok: dict[int, str] = {int(i): s for s, i in m["vocab"].items()}
    special_ids, user_ids = set(), set()
    for a in j.get("added_tokens") or []:
        id_to_tok[int(a["id"])] = a["content"]
        (special_ids if a.get("special") else user_ids).add(int(a["id"]))
    V = model.config.vocab_size
    if id_to_tok and max(id_to_tok) >= V:
        raise MambaDebugError(f"{where}: the tokenizer has ids up to {max(id_to_tok)} but the embedding has only {V} "
                              f"rows; the tokenizer does not belong to these weights")
    tokens, types = [], []
    for i in range(V):
        if i not in id_to_tok:
            tokens.append(f"[PAD{i}]")              # pad the token list to the embedding rows, as the converter does
            types.append(TOKEN_UNUSED)
        else:
            tokens.append(id_to_tok[i])
            types.append(TOKEN_CONTROL if i in special_ids else TOKEN_USER_DEFINED if i in user_ids else TOKEN_NORMAL)
    merges = [" ".join(x) if isinstance(x, (list, tuple)) else str(x) for x in m.get("merges") or []]
    out = {"tokens": tokens, "types": types, "merges": merges, "pre": _pre_name(j.get("pre_tokenizer"))}
    out.update(_special_ids(model, {id_to_tok[i]: i for i in special_ids}))
    return out


def _is_byte_level(pre) -> bool:
    if not pre:
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers", []))


def _pre_name(pre) -> str:
    """tokenizer.ggml.pre for a tokenizers pre-tokenizer: 'gpt-2' (ByteLevel regex) or 'llama-bpe'."""
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    for p in pre.get("pretokenizers", []):
        pattern = (p.get("pattern") or {}).get("Regex") if p.get("type") == "Split" else None
        if pattern and pattern.replace("\\\\", "\\") == LLAMA3_REGEX:
            return "llama-bpe"
    return "gpt-2"


def _special_ids(model: MambaModel, specials: dict[str, int]) -> dict:
    """bos/eos/pad/unk ids: config.json next to the model's source folder, else the special tokens' names."""
    ids: dict[str, int | None] = {}
    folder = Path(str(model.source).split(" [")[0])
    cfg = folder / "config.json" if folder.is_dir() else None
    if cfg is not None and cfg.is_file():
        try:
            raw = json.loads(cfg.read_text())
            for key in ("bos", "eos", "pad"):
                v = raw.get(f"{key}_token_id")
                if isinstance(v, int) and 0 <= v < model.config.vocab_size:
                    ids[key] = v
        except (OSError, json.JSONDecodeError):
            pass
    if "eos" not in ids:
        for name, i in specials.items():
            if re.search(r"eos|endoftext|</s>|end_of_text", name, re.I):
                ids["eos"] = i
                break
        else:
            if len(specials) == 1:
                ids["eos"] = next(iter(specials.values()))
    if "bos" not in ids:
        for name, i in specials.items():
            if re.search(r"bos|<s>|begin_of_text|startoftext", name, re.I):
                ids["bos"] = i
                break
        else:
            if "eos" in ids:
                ids["bos"] = ids["eos"]             # GPT-2 style: one <|endoftext|> serves as both
    return ids


def describe_gguf(path) -> str:
    """One line per fact of a written GGUF (architecture, dimensions, tensor types, tokenizer, size)."""
    gguf = _gguf()
    path = Path(path)
    reader = gguf.GGUFReader(str(path), "r")
    f = lambda k: (reader.get_field(k).contents() if reader.get_field(k) is not None else None)  # noqa: E731
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    tied = all(t.name != "output.weight" for t in reader.tensors)
    tok = f("tokenizer.ggml.model")
    n_tok = len(reader.get_field("tokenizer.ggml.tokens").data) if reader.get_field("tokenizer.ggml.tokens") else 0
    lines = [
        f"wrote     {path} ({path.stat().st_size / 2**20:.2f} MiB)",
        f"arch      {f('general.architecture')}: n_layer {f('mamba.block_count')}, n_embd "
        f"{f('mamba.embedding_length')}, d_inner {f('mamba.ssm.inner_size')}, d_state {f('mamba.ssm.state_size')}, "
        f"d_conv {f('mamba.ssm.conv_kernel')}, dt_rank {f('mamba.ssm.time_step_rank')}, "
        f"rms_eps {f('mamba.attention.layer_norm_rms_epsilon'):g}",
        f"tensors   {len(reader.tensors)}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + (" (output tied to token_embd)" if tied else ""),
        f"tokenizer {tok}" + (f", {n_tok} tokens, pre {f('tokenizer.ggml.pre')!r}, "
                              f"bos {f('tokenizer.ggml.bos_token_id')}, eos {f('tokenizer.ggml.eos_token_id')}"
                              if tok == "gpt2" else
                              f", vocab_size {f('mamba.vocab_size')} (no tokenizer in the model)"),
    ]
    del reader
    return "\n".join(lines)


# =================================================================================================
# command line
# =================================================================================================
def cmd_export_gguf(args) -> int:
    from .loading import load_model  # noqa: PLC0415

    model = load_model(args.model)
    out = export_gguf(model, args.out, dtype=args.dtype)
    print(f"# {model!r} -> GGUF {args.dtype}")
    print(describe_gguf(out))
    return 0


def add_gguf_commands(sub) -> None:
    """Register `export-gguf --out FILE [--model PATH] [--dtype f32|f16|bf16|q8_0]` on an argparse subparsers."""
    p = sub.add_parser("export-gguf", help="write the model as a llama.cpp GGUF (architecture mamba)",
                       description="Write a Mamba-1 model as a GGUF file that llama.cpp loads (same keys, tensor "
                                   "names and shapes as llama.cpp's convert_hf_to_gguf.py). Norms, conv, x/dt "
                                   "projections, A and D stay F32; --dtype sets the embedding, in_proj and out_proj.")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--model", default=None, help="HF Mamba folder or .gguf file (default: the shipped tiny model)")
    p.add_argument("--dtype", default="f32", choices=list(DTYPES),
                   help="type of the big matrices (default f32; q8_0 falls back to f16 for rows not a multiple of 32)")
    p.set_defaults(func=cmd_export_gguf)
