"""GGUF gpt2 vocabulary (`tokenizer.ggml.*`) <-> `tokenizers.Tokenizer` (byte-level BPE).

Reading rebuilds a byte-level BPE with the tokenizers library from llama.cpp's token list, merges and token types;
writing takes the token list, special tokens and merges from the library's own view of a tokenizer
(`get_vocab()`, `get_added_tokens_decoder()`, the BPE model's serialized merges), padded to
the embedding rows with `[PAD{i}]` tokens (type UNUSED) as llama.cpp's converter does.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import MambaDebugError
from ..model import MambaModel

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer is the GPT-2 regex (= tokenizers' ByteLevel regex)
GPT2_REGEX_PRES = {"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                   "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling"}
# ... and those with the Llama-3 regex (llama.cpp also sets ignore_merges for most of them)
LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
               "jina-v5-nano", "dbrx", "smaug"}
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


# -- reading ---------------------------------------------------------------------------------------
def read_tokenizer(reader) -> tuple:
    """(tokenizers.Tokenizer | None, notes) from a GGUFReader's tokenizer.ggml.* metadata; notes say what was
    not carried over (a missing or unsupported tokenizer never stops the weights from loading)."""
    model = reader.get_field("tokenizer.ggml.model")
    if model is None:
        return None, ["no tokenizer in the GGUF"]
    try:
        model = model.contents()
        if model in ("none", "no_vocab"):
            return None, ["no tokenizer in the GGUF (tokenizer.ggml.model = none)"]
        if model != "gpt2":
            return None, [f"tokenizer.ggml.model {model!r} is not rebuilt (only gpt2-style byte-level BPE is)"]
        tokens = reader.get_field("tokenizer.ggml.tokens").contents()
        merges_f = reader.get_field("tokenizer.ggml.merges")
        if merges_f is None:
            return None, ["gpt2 tokenizer without merges is not rebuilt"]
        merges = merges_f.contents()
        types_f = reader.get_field("tokenizer.ggml.token_type")
        types = types_f.contents() if types_f is not None else [TOKEN_NORMAL] * len(tokens)
        pre_f = reader.get_field("tokenizer.ggml.pre")
        pre = pre_f.contents() if pre_f is not None else "default"
    except Exception as exc:  # noqa: BLE001 - a damaged tokenizer must not stop the weights from loading
        return None, [f"tokenizer metadata unreadable ({type(exc).__name__}: {exc})"]
    try:
        return build_bpe_tokenizer(tokens, merges, types, pre)
    except Exception as exc:  # noqa: BLE001
        return None, [f"the gpt2 tokenizer could not be rebuilt ({type(exc).__name__}: {exc})"]


def build_bpe_tokenizer(tokens: list[str], merges: list[str], types: list[int], pre: str) -> tuple:
    """(a byte-level BPE `tokenizers.Tokenizer`, notes) from llama.cpp's gpt2-style token list and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)                            # a repeated token keeps its first id, as llama.cpp's
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
    llama3 = pre in LLAMA3_PRES
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, **({"ignore_merges": True} if llama3 else {})))
    if llama3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre not in GPT2_REGEX_PRES:
            notes.append(f"tokenizer pre-type {pre!r} approximated by the GPT-2 regex; text may split differently "
                         f"from llama.cpp (token ids given directly are unaffected)")
    tok.decoder = decoders.ByteLevel()
    # tokens of type CONTROL / USER_DEFINED become added tokens at their own ids (they are in the BPE vocab)
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == TOKEN_CONTROL and vocab.get(tokens[i]) == i]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TOKEN_USER_DEFINED and vocab.get(tokens[i]) == i]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok, notes


# -- writing ---------------------------------------------------------------------------------------
def tokenizer_vocab(model: MambaModel) -> dict:
    """gpt2-style token list / types / merges / pre / special ids of the model's byte-level BPE tokenizer."""
    from tokenizers import models  # noqa: PLC0415

    tok = model.tokenizer
    where = model.source or "this model"
    pre = tok.pre_tokenizer
    if not isinstance(tok.model, models.BPE) or not _is_byte_level(pre):
        raise MambaDebugError(f"{where}: the tokenizer is {type(tok.model).__name__} with pre-tokenizer "
                              f"{type(pre).__name__ if pre is not None else None}; llama.cpp's gpt2 tokenizer needs "
                              f"a byte-level BPE. Drop the tokenizer (model.tokenizer = None) to export the weights "
                              f"alone")
    added = dict(sorted(tok.get_added_tokens_decoder().items()))       # id -> AddedToken, by id
    id_to_tok = {i: s for s, i in tok.get_vocab(with_added_tokens=False).items()}
    id_to_tok.update({i: a.content for i, a in added.items()})
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
            types.append(TOKEN_NORMAL if i not in added else TOKEN_CONTROL if added[i].special else TOKEN_USER_DEFINED)
    # the BPE model has no merges getter: its own serialization (what tokenizer.json holds under "model") has them
    merges = json.loads(tok.model.__getstate__()).get("merges") or []
    merges = [" ".join(x) if isinstance(x, (list, tuple)) else str(x) for x in merges]
    out = {"tokens": tokens, "types": types, "merges": merges, "pre": _pre_name(pre)}
    out.update(_special_ids(model, {a.content: i for i, a in added.items() if a.special}))
    return out


def add_vocab(writer, vocab: dict | None, vocab_size: int) -> None:
    """Write `tokenizer_vocab`'s result (None: no tokenizer) as tokenizer.ggml.* metadata."""
    if vocab is None:
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(vocab_size)
        return
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    for key, adder in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):
        if vocab.get(key) is not None:
            adder(vocab[key])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _parts(pre) -> list:
    from tokenizers import pre_tokenizers  # noqa: PLC0415
    return list(pre) if isinstance(pre, pre_tokenizers.Sequence) else [pre]


def _is_byte_level(pre) -> bool:
    from tokenizers import pre_tokenizers  # noqa: PLC0415
    return pre is not None and any(isinstance(p, pre_tokenizers.ByteLevel) for p in _parts(pre))


def _pre_name(pre) -> str:
    """tokenizer.ggml.pre for a tokenizers pre-tokenizer: 'gpt-2' (ByteLevel regex) or 'llama-bpe'."""
    from tokenizers import pre_tokenizers  # noqa: PLC0415

    if isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex:
        return "gpt-2"
    for p in _parts(pre):
        if isinstance(p, pre_tokenizers.Split):            # no pattern getter: read it from its serialization
            pattern = (json.loads(p.__getstate__()).get("pattern") or {}).get("Regex")
            if pattern and pattern.replace("\\\\", "\\") == LLAMA3_REGEX:
                return "llama-bpe"
    return "gpt-2"


def _special_ids(model: MambaModel, specials: dict[str, int]) -> dict:
    """bos/eos/pad/unk ids: config.json next to the model's source folder, else the special tokens' names."""
    ids: dict[str, int | None] = {}
    folder = Path(model.source) if model.source else None
    cfg = folder / "config.json" if folder is not None and folder.is_dir() else None
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
