#!/usr/bin/env python3
"""Train the tiny Mamba-1 language model shipped in ``data/tiny-mamba/``.

Corpus
    Jane Austen's six completed novels, as shipped by the Debian package
    ``r-cran-janeaustenr`` (version 1.0.0-1, MIT licence for the package; the
    novels themselves are public domain). The package stores the texts in an R
    lazy-load database (``data/Rdata.rdx`` + ``data/Rdata.rdb``); this script
    reads that database with a small built-in reader of R's XDR serialization,
    so R itself is not needed. The files are found, in this order, at:

    1. ``--austen-dir DIR`` (a folder holding ``Rdata.rdx`` and ``Rdata.rdb``);
    2. ``/usr/lib/R/site-library/janeaustenr/data`` (after
       ``apt-get install r-cran-janeaustenr``, which also pulls in R);
    3. ``.cache/janeaustenr/`` under the repository root: the script runs
       ``apt-get download r-cran-janeaustenr=1.0.0-1`` there (no R, no
       dependencies), checks the .deb's SHA-256 and unpacks it with ``dpkg -x``.
       A .deb already in that folder is reused (this is how it travels to a
       machine with no registry access).

Pipeline
    paragraphs -> last 5% of each novel held out for validation -> byte-level
    BPE (``tokenizers``, vocab 4096) trained on the training split only ->
    ``MambaForCausalLM`` (d_model 128, d_inner 256, d_state 16, d_conv 4,
    12 layers, tied embeddings) trained with AdamW on random windows.
    The selective scan runs in pure torch through ``use_mambapy=True``
    (``pip install mambapy==1.2.0``; without it transformers falls back to its
    sequential loop, which gives the same numbers but is slower).

Outputs (``--out-dir``, default ``data/tiny-mamba``)
    config.json, generation_config.json, model.safetensors (float32),
    tokenizer.json, tokenizer_config.json, train_log.jsonl (one JSON object per
    evaluation: step, train_loss = mean training loss since the previous
    evaluation, val_loss / val_ppl on the whole held-out split, lr,
    tokens_seen, tokens_per_s, elapsed_s), summary.json (numbers of the saved
    weights and of the last step, samples, corpus provenance) and val.txt (the
    held-out validation text). The saved weights are those of the evaluation
    with the lowest validation loss (``--no-keep-best`` saves the last ones):
    the corpus is only about 0.9M tokens and the model overfits it after a few
    hundred steps.

Reproduce (on the machine that made the shipped files, one NVIDIA H200)::

    pip install mambapy==1.2.0
    python3 data/train_tiny_mamba.py --out-dir data/tiny-mamba

The run is seeded (``--seed``, default 0); bit-exact results across hardware
and library versions are not promised (GPU reductions are not deterministic).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEB_NAME = "r-cran-janeaustenr"
DEB_VERSION = "1.0.0-1"
DEB_FILE = f"{DEB_NAME}_{DEB_VERSION}_all.deb"
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
SYSTEM_DATA_DIR = Path("/usr/lib/R/site-library/janeaustenr/data")
CACHE_DIR = REPO_ROOT / ".cache" / "janeaustenr"
# Stable order of the novels (publication order).
NOVELS = [
    ("sensesensibility", "Sense and Sensibility"),
    ("prideprejudice", "Pride and Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
]
EOS = "<|endoftext|>"

PROMPTS = [
    "It was a fine morning, and",
    "Mr. Darcy said that",
    "She could not help thinking that",
    "The family had been settled",
]


# --------------------------------------------------------------------------
# Corpus: R lazy-load database reader
# --------------------------------------------------------------------------
class _RReader:
    """Minimal reader of R's XDR serialization (formats 2 and 3).

    Handles what a data package's lazy-load database holds for character data:
    NULL, symbols, pairlists, CHARSXP, logical/integer/double/character
    vectors, lists and attributes. Vectors come back as
    ``{"type": int, "value": list, "attr": dict}``.
    """

    def __init__(self, buf: bytes):
        self.b, self.p, self.refs = buf, 0, []

    def _int(self) -> int:
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def read(self):
        if self.b[:2] != b"X\n":
            raise ValueError(f"not an XDR R serialization: {self.b[:2]!r}")
        self.p = 2
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader version
        if version == 3:
            self.p += 4 + struct.unpack_from(">i", self.b, self.p)[0]  # native encoding
        return self._item()

    def _item(self):
        flags = self._int()
        t = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t == 254:  # NILVALUE_SXP
            return None
        if t in (241, 242, 250, 251, 252, 253):  # environments / special markers
            return ("<special>", t)
        if t == 255:  # REFSXP
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            sym = ("sym", self._item())
            self.refs.append(sym)
            return sym
        if t == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None  # NA_character_
            s = self.b[self.p:self.p + n].decode("utf-8", "replace")
            self.p += n
            return s
        if t in (2, 6, 239, 240):  # LISTSXP, LANGSXP, ATTRLISTSXP, ATTRLANGSXP
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            car, cdr = self._item(), self._item()
            out = [(tag[1] if tag else None, car)]
            return out + cdr if isinstance(cdr, list) else out
        n = self._int()
        if t in (10, 13):  # LGLSXP, INTSXP
            value = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            value = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            value = [self._item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R SEXP type {t}")
        attr = self._item() if has_attr else None
        return {"type": t, "value": value, "attr": dict(attr) if attr else {}}


def read_r_lazydata(data_dir: Path) -> dict[str, list[str]]:
    """Return {object name: character vector} from an R package's data/ folder."""
    index = _RReader(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).read()
    top = dict(zip(index["attr"]["names"]["value"], index["value"]))
    variables = top["variables"]
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, loc in zip(variables["attr"]["names"]["value"], variables["value"]):
        offset, length = (int(x) for x in loc["value"])
        chunk = rdb[offset:offset + length]
        # Each entry: 4-byte big-endian uncompressed length, then a zlib stream.
        obj = _RReader(zlib.decompress(chunk[4:])).read()
        if isinstance(obj, dict) and obj["type"] == 16:
            out[name] = [s if s is not None else "" for s in obj["value"]]
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def locate_corpus(austen_dir: str | None) -> tuple[Path, dict]:
    """Find (or fetch with apt-get download) the janeaustenr data folder."""
    if austen_dir:
        return Path(austen_dir), {"source": f"--austen-dir {austen_dir}"}
    if (SYSTEM_DATA_DIR / "Rdata.rdb").exists():
        return SYSTEM_DATA_DIR, {"source": f"installed package ({SYSTEM_DATA_DIR})"}
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    deb = CACHE_DIR / DEB_FILE
    if not deb.exists():
        print(f"[corpus] apt-get download {DEB_NAME}={DEB_VERSION} into {CACHE_DIR}", flush=True)
        subprocess.run(["apt-get", "download", f"{DEB_NAME}={DEB_VERSION}"], cwd=CACHE_DIR, check=True)
    digest = _sha256(deb)
    if digest != DEB_SHA256:
        raise SystemExit(f"{deb}: sha256 {digest} != expected {DEB_SHA256}")
    root = CACHE_DIR / "root"
    data_dir = root / "usr/lib/R/site-library/janeaustenr/data"
    if not (data_dir / "Rdata.rdb").exists():
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return data_dir, {"source": f"apt-get download {DEB_NAME}={DEB_VERSION}", "deb_sha256": digest}


def novel_paragraphs(lines: list[str]) -> list[str]:
    """Join wrapped lines into paragraphs; drop italics underscores."""
    paras, cur = [], []
    for line in lines + [""]:
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            p = " ".join(cur).replace("_", "")
            paras.append(re.sub(r"\s+", " ", p).strip())
            cur = []
    return [p for p in paras if p]


def build_corpus(data_dir: Path, val_frac: float) -> tuple[str, str, dict]:
    texts = read_r_lazydata(data_dir)
    train_parts, val_parts, stats = [], [], {}
    for key, title in NOVELS:
        paras = novel_paragraphs(texts[key])
        total = sum(len(p) + 1 for p in paras)
        # Hold out the last val_frac of each novel (by characters, whole paragraphs).
        cut, acc = len(paras), 0
        for i in range(len(paras) - 1, -1, -1):
            acc += len(paras[i]) + 1
            if acc >= val_frac * total:
                cut = i
                break
        train_parts.append("\n".join(paras[:cut]))
        val_parts.append("\n".join(paras[cut:]))
        stats[title] = {"paragraphs": len(paras), "chars": total, "val_paragraphs": len(paras) - cut}
    return "\n\n".join(train_parts) + "\n", "\n\n".join(val_parts) + "\n", stats


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------
def train_tokenizer(train_text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Feed paragraphs (deterministic order) rather than one huge string.
    tok.train_from_iterator(train_text.split("\n"), trainer=trainer)
    return tok


def encode(tok, text: str) -> list[int]:
    ids: list[int] = []
    # Encode paragraph by paragraph (newlines kept) so the encoder stays fast.
    lines = text.split("\n")
    batch = [ln + "\n" for ln in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    for enc in tok.encode_batch(batch):
        ids.extend(enc.ids)
    return ids


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "data" / "tiny-mamba"))
    ap.add_argument("--austen-dir", default=None, help="folder with the package's Rdata.rdx/Rdata.rdb")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--state-size", type=int, default=16)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--no-keep-best", action="store_true",
                    help="save the last weights instead of those with the lowest validation loss")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="stop early (and record it) once training has run this long; 0 = no limit")
    ap.add_argument("--device", default="cuda", help="cuda if available, else cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = ap.parse_args()

    import torch
    from transformers import MambaConfig, MambaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils.import_utils import is_mambapy_available

    if args.device == "cuda" and not torch.cuda.is_available():
        args.device = "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # keep float32 numerics
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    # ---- corpus --------------------------------------------------------
    data_dir, provenance = locate_corpus(args.austen_dir)
    train_text, val_text, book_stats = build_corpus(data_dir, args.val_frac)
    print(f"[corpus] {data_dir}: train {len(train_text):,} chars, val {len(val_text):,} chars", flush=True)
    (out_dir / "val.txt").write_text(val_text, encoding="utf-8")

    # ---- tokenizer -----------------------------------------------------
    tok = train_tokenizer(train_text, args.vocab_size)
    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)
    hf_tok.model_max_length = 1_000_000
    hf_tok.save_pretrained(out_dir)
    train_ids = torch.tensor(encode(tok, train_text), dtype=torch.long)
    val_ids = torch.tensor(encode(tok, val_text), dtype=torch.long)
    sample_back = tok.decode(encode(tok, val_text[:200]))
    assert sample_back == val_text[:200], "tokenizer round trip failed"
    print(f"[tokenizer] vocab {vocab}, train {len(train_ids):,} tokens, val {len(val_ids):,} tokens "
          f"({len(train_text) / len(train_ids):.2f} chars/token)", flush=True)

    # ---- model ---------------------------------------------------------
    cfg = MambaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        state_size=args.state_size,
        num_hidden_layers=args.layers,
        expand=args.expand,
        conv_kernel=args.conv_kernel,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank="auto",
        residual_in_fp32=True,
        tie_word_embeddings=True,
        use_mambapy=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    model = MambaForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {n_params:,} parameters; d_inner {cfg.intermediate_size}; dt_rank {cfg.time_step_rank}; "
          f"mambapy available: {is_mambapy_available()}; device {device}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "A_log" not in n and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "A_log" not in n and "embeddings" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    gen = torch.Generator().manual_seed(args.seed)
    L, B = args.seq_len, args.batch_size

    def batch():
        starts = torch.randint(0, len(train_ids) - L - 1, (B,), generator=gen)
        x = torch.stack([train_ids[s:s + L + 1] for s in starts.tolist()])
        return x.to(device, non_blocking=True)

    n_val = (len(val_ids) - 1) // L
    val_x = torch.stack([val_ids[i * L:i * L + L + 1] for i in range(n_val)])

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total, count = 0.0, 0
        for i in range(0, n_val, B):
            xb = val_x[i:i + B].to(device)
            logits = model(input_ids=xb[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), xb[:, 1:].reshape(-1),
                                                     reduction="sum")
            total += loss.item()
            count += xb[:, 1:].numel()
        model.train()
        return total / count

    log_path = out_dir / "train_log.jsonl"
    log_f = open(log_path, "w")
    model.train()
    t_train = time.time()
    tokens_since, t_since, loss_sum, loss_n = 0, time.time(), 0.0, 0
    stopped_early = False
    step = 0
    best = {"val_loss": float("inf"), "step": 0, "state": None}
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1)
        xb = batch()
        logits = model(input_ids=xb[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        loss_sum += loss.item()
        loss_n += 1
        tokens_since += B * L
        elapsed_train = time.time() - t_train
        if args.max_minutes and elapsed_train > 60 * args.max_minutes:
            stopped_early = True
        if step % args.eval_every == 0 or step == args.steps or step == 1 or stopped_early:
            if device.type == "cuda":
                torch.cuda.synchronize()
            tps = tokens_since / (time.time() - t_since)
            val_loss = evaluate()
            rec = {
                "step": step,
                "train_loss": round(loss_sum / loss_n, 5),
                "val_loss": round(val_loss, 5),
                "val_ppl": round(math.exp(val_loss), 3),
                "lr": round(lr_at(step - 1), 7),
                "tokens_seen": step * B * L,
                "tokens_per_s": round(tps, 1),
                "elapsed_s": round(time.time() - t_start, 1),
            }
            if val_loss < best["val_loss"]:
                best = {"val_loss": val_loss, "step": step, "train_loss": rec["train_loss"],
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            print(json.dumps(rec), flush=True)
            tokens_since, t_since, loss_sum, loss_n = 0, time.time(), 0.0, 0
        if stopped_early:
            print(f"[train] stopping early at step {step}: --max-minutes {args.max_minutes} reached", flush=True)
            break
    log_f.close()
    train_seconds = time.time() - t_train

    # ---- save ----------------------------------------------------------
    # The corpus is small (about 0.9M tokens), so the model overfits after a few
    # epochs: keep the weights of the evaluation with the lowest validation loss.
    saved_step = step
    if not args.no_keep_best and best["state"] is not None:
        model.load_state_dict(best["state"])
        saved_step = best["step"]
        print(f"[save] weights of step {saved_step} (best val loss {best['val_loss']:.5f})", flush=True)
    model = model.to("cpu").float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    hf_tok.save_pretrained(out_dir)

    samples = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=48, do_sample=False, pad_token_id=eos_id)
        samples.append({"prompt": prompt, "greedy": tok.decode(out[0].tolist())})
        print(f"[sample] {samples[-1]['greedy']!r}", flush=True)

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    last = records[-1]
    chosen = next(r for r in records if r["step"] == saved_step)
    summary = {
        "corpus": {
            "package": f"{DEB_NAME} {DEB_VERSION} (Debian)",
            "package_licence": "MIT (Julia Silge; Debian packaging Andreas Tille)",
            "text_licence": "public domain (novels by Jane Austen, 1811-1817)",
            "books": book_stats,
            "train_chars": len(train_text),
            "val_chars": len(val_text),
            **provenance,
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": vocab, "eos": EOS, "eos_id": eos_id,
                      "train_tokens": len(train_ids), "val_tokens": len(val_ids)},
        "model": {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                  "state_size": cfg.state_size, "conv_kernel": cfg.conv_kernel,
                  "num_hidden_layers": cfg.num_hidden_layers, "time_step_rank": cfg.time_step_rank,
                  "vocab_size": cfg.vocab_size, "parameters": n_params},
        "training": {"steps": step, "planned_steps": args.steps, "stopped_early": stopped_early,
                     "batch_size": B, "seq_len": L, "tokens_seen": step * B * L, "lr": args.lr,
                     "warmup": args.warmup, "weight_decay": args.weight_decay, "seed": args.seed,
                     "train_seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t_start, 1),
                     "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "mambapy_scan": is_mambapy_available(), "argv": sys.argv[1:]},
        "saved_weights": {"step": chosen["step"], "train_loss": chosen["train_loss"],
                          "val_loss": chosen["val_loss"], "val_ppl": chosen["val_ppl"]},
        "last_step": {"step": last["step"], "train_loss": last["train_loss"],
                      "val_loss": last["val_loss"], "val_ppl": last["val_ppl"]},
        "samples": samples,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[done] saved {json.dumps(summary['saved_weights'])} in {summary['training']['total_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
