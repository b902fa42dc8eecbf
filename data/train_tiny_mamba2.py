"""Train the tiny Mamba-2 (``data/tiny-mamba2/``) and Granite-4.0-H-style hybrid (``data/tiny-granite-hybrid/``)
language models on the same Jane Austen corpus, split and tokenizer as the shipped Mamba-1 model.

The corpus, validation split and training loop are those of ``data/train_tiny_mamba.py`` (read its docstring for
the provenance of the text: Debian ``r-cran-janeaustenr`` 1.0.0-1, the .deb reused from ``.cache/janeaustenr/``).
The tokenizer is not retrained: the shipped ``data/tiny-mamba/tokenizer.json`` (byte-level BPE, 4096) is reused,
so the three tiny models read the same token ids.

    --arch mamba2   Mamba2ForCausalLM: d_model 128, d_inner 256, 8 heads of 32, 2 groups, d_state 32, d_conv 4,
                    chunk 64, 12 layers (--layers), tied embeddings
    --arch granite  GraniteMoeHybridForCausalLM, dense (num_local_experts 0): d_model 128, 8 layers (--layers),
                    Mamba-2 mixers (8 heads of 32, 2 groups, d_state 32) except attention (4 query / 2 kv heads of
                    32, no positions) at every third layer from layer 2 (2 and 5 of 8), each followed by the shared SwiGLU feed-forward (256),
                    multipliers embedding 4, residual 0.5, attention 0.125, logits scaling 2

transformers runs its pure-torch Mamba-2 path (keep mamba_ssm and causal_conv1d out of the environment). Same
outputs as the Mamba-1 script: config.json, model.safetensors, tokenizer files, train_log.jsonl, summary.json.

Reproduce (the shipped folders were made on a shared 2-core CPU, 22 minutes each, one thread; summary.json holds
the exact arguments)::

    python3 data/train_tiny_mamba2.py --arch mamba2 --device cpu --threads 1 --layers 8 --batch-size 16 \
        --seq-len 128 --steps 700 --warmup 50 --max-minutes 22
    python3 data/train_tiny_mamba2.py --arch granite --device cpu --threads 1 --batch-size 16 --seq-len 128 \
        --steps 600 --warmup 50 --max-minutes 22
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = {"mamba2": HERE / "tiny-mamba2", "granite": HERE / "tiny-granite-hybrid"}
PROMPTS = ["It was a fine morning, and", "Mr. Darcy", "She could not help"]


def _mamba1_script():
    spec = importlib.util.spec_from_file_location("train_tiny_mamba", HERE / "train_tiny_mamba.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_config(arch: str, vocab: int, eos: int, layers: int = 0):
    from transformers import GraniteMoeHybridConfig, Mamba2Config
    ids = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if arch == "mamba2":
        return Mamba2Config(vocab_size=vocab, hidden_size=128, expand=2, num_heads=8, head_dim=32, n_groups=2,
                            state_size=32, conv_kernel=4, chunk_size=64, num_hidden_layers=layers or 12,
                            tie_word_embeddings=True, residual_in_fp32=True, **ids)
    layers = layers or 8
    kinds = ["attention" if i % 3 == 2 else "mamba" for i in range(layers)]
    return GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        shared_intermediate_size=256, num_local_experts=0, layer_types=kinds, mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=32, mamba_d_head=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0,
        position_embedding_type="nope", tie_word_embeddings=True, rms_norm_eps=1e-5, **ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(OUT), required=True)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--austen-dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop early once training ran this long")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--layers", type=int, default=0, help="0 = 12 (mamba2) / 8 (granite)")
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    m1 = _mamba1_script()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        args.device = "cpu"
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    out_dir = Path(args.out_dir or OUT[args.arch])
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    data_dir, provenance = m1.locate_corpus(args.austen_dir)
    train_text, val_text, book_stats = m1.build_corpus(data_dir, 0.05)
    tok = Tokenizer.from_file(str(HERE / "tiny-mamba" / "tokenizer.json"))
    eos = tok.token_to_id(m1.EOS)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=m1.EOS, bos_token=m1.EOS, unk_token=m1.EOS,
                                     pad_token=m1.EOS)
    hf_tok.model_max_length = 1_000_000
    train_ids = torch.tensor(m1.encode(tok, train_text), dtype=torch.long)
    val_ids = torch.tensor(m1.encode(tok, val_text), dtype=torch.long)
    print(f"[corpus] train {len(train_ids):,} tokens, val {len(val_ids):,} tokens", flush=True)

    cfg = make_config(args.arch, tok.get_vocab_size(), eos, args.layers)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {args.arch}: {n_params:,} parameters on {device}", flush=True)

    def decays(n, p):
        return p.dim() >= 2 and "A_log" not in n and "embed" not in n
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if decays(n, p)], "weight_decay": args.weight_decay},
         {"params": [p for n, p in model.named_parameters() if not decays(n, p)], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    gen = torch.Generator().manual_seed(args.seed)
    L, B = args.seq_len, args.batch_size
    n_val = (len(val_ids) - 1) // L
    val_x = torch.stack([val_ids[i * L:i * L + L + 1] for i in range(n_val)])

    def loss_of(xb):
        logits = model(input_ids=xb[:, :-1], use_cache=False).logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), xb[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate():
        model.eval()
        total = sum(loss_of(val_x[i:i + B].to(device)).item() * val_x[i:i + B, 1:].numel() for i in range(0, n_val, B))
        model.train()
        return total / val_x[:, 1:].numel()

    log_path = out_dir / "train_log.jsonl"
    log_f = open(log_path, "w")
    best = {"val_loss": float("inf"), "step": 0, "state": None}
    t_train = time.time()
    loss_sum, loss_n, stopped_early, step = 0.0, 0, False, 0
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1)
        starts = torch.randint(0, len(train_ids) - L - 1, (B,), generator=gen)
        loss = loss_of(torch.stack([train_ids[s:s + L + 1] for s in starts.tolist()]).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
        stopped_early = bool(args.max_minutes) and time.time() - t_train > 60 * args.max_minutes
        if step % args.eval_every == 0 or step in (1, args.steps) or stopped_early:
            val_loss = evaluate()
            rec = {"step": step, "train_loss": round(loss_sum / loss_n, 5), "val_loss": round(val_loss, 5),
                   "val_ppl": round(math.exp(val_loss), 3), "lr": round(lr_at(step - 1), 7),
                   "tokens_seen": step * B * L, "elapsed_s": round(time.time() - t_start, 1)}
            if val_loss < best["val_loss"]:
                best = {"val_loss": val_loss, "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            print(json.dumps(rec), flush=True)
            loss_sum, loss_n = 0.0, 0
        if stopped_early:
            break
    log_f.close()
    train_seconds = time.time() - t_train
    model.load_state_dict(best["state"])
    model = model.to("cpu").float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    hf_tok.save_pretrained(out_dir)

    samples = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=32, do_sample=False, pad_token_id=eos)
        samples.append({"prompt": prompt, "greedy": tok.decode(out[0].tolist())})
        print(f"[sample] {samples[-1]['greedy']!r}", flush=True)
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    chosen = next(r for r in records if r["step"] == best["step"])
    summary = {
        "corpus": {"package": f"{m1.DEB_NAME} {m1.DEB_VERSION} (Debian)", "books": book_stats,
                   "train_tokens": len(train_ids), "val_tokens": len(val_ids), **provenance},
        "tokenizer": "data/tiny-mamba/tokenizer.json (byte-level BPE, 4096), reused",
        "model": {"arch": args.arch, "parameters": n_params, "config": json.loads(cfg.to_json_string())},
        "training": {"steps": step, "planned_steps": args.steps, "stopped_early": stopped_early, "batch_size": B,
                     "seq_len": L, "lr": args.lr, "seed": args.seed, "train_seconds": round(train_seconds, 1),
                     "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "argv": sys.argv[1:]},
        "saved_weights": {k: chosen[k] for k in ("step", "train_loss", "val_loss", "val_ppl")},
        "last_step": {k: records[-1][k] for k in ("step", "train_loss", "val_loss", "val_ppl")},
        "samples": samples,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[done] {json.dumps(summary['saved_weights'])} in {round(time.time() - t_start, 1)} s", flush=True)


if __name__ == "__main__":
    main()
