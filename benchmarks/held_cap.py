"""Goal 1's open question: does `Capture.held_cap` (device sites waiting before a measurement) pay above 1 GiB?

`gpu_tracing.py` times its levels one after the other, each against untraced runs beside it; on a lend whose pairs
spread 0.96-1.63x, two levels 2% apart are not told apart that way. Here the untraced prefill and the at-birth
prefill at each cap run in one loop, their order rotating every round, and each traced run is divided by the same
round's untraced one. Prints medians and quartiles; records nothing (the decision goes to benchmarks/README.md).

    TRITON_INTERPRET=0 python3 benchmarks/held_cap.py [--rounds 24] [--caps 1,2,4]   # on a GPU
    python3 benchmarks/held_cap.py --small                                           # a check on a CPU
"""
from __future__ import annotations

import argparse
import statistics

import torch

from gpu_common import BIG, CUDA, SMALL, log, mamba_ssm_params, once, prefill
from gpu_tracing import AtBirthHeld
from mamba_debug.backends import device_backend
from mamba_debug.config import MambaConfig
from mamba_debug.model import MambaModel, Runner


def runs(model, dev, tokens, ubatch, caps) -> dict:
    """name -> a prefill: the untraced one, then one measured at birth per cap (GiB)."""
    plain = Runner(model, dev)
    out = {"untraced": lambda: prefill(plain, tokens, ubatch)}
    for gib in caps:
        tap = AtBirthHeld(int(gib * 2**30))
        runner = Runner(model, dev, observer=tap)

        def traced(tap=tap, runner=runner):
            tap.kept.clear()               # one prefill's metrics kept at a time
            return prefill(runner, tokens, ubatch, tap.take)
        out[f"{gib:g} GiB"] = traced
    return out


def rotate(fns: dict, rounds: int) -> dict:
    """name -> seconds per round, the order of the runs shifted by one each round (none always first)."""
    names = list(fns)
    times = {n: [] for n in names}
    for i in range(rounds):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(once(fns[n]))
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="4 layers, d_model 256, 256 tokens: a check on a CPU")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the rotating loop (default 24; 2)")
    ap.add_argument("--caps", default="1,2,4", help="held_cap values in GiB, comma-separated")
    args = ap.parse_args(argv)
    cfg = MambaConfig(**(SMALL if args.small else BIG))
    n_tok, ubatch = (256, 64) if args.small else (2048, 512)
    rounds = args.rounds or (2 if args.small else 24)
    model = MambaModel(cfg, mamba_ssm_params(cfg, 0, "cuda" if CUDA else "cpu"), source="random mamba_ssm init")
    dev = device_backend("triton", "cuda" if CUDA else "interpret")
    tokens = torch.randint(0, cfg.vocab_size, (1, n_tok), generator=torch.Generator().manual_seed(1))
    fns = runs(model, dev, tokens, ubatch, [float(c) for c in args.caps.split(",")])
    for fn in fns.values():                # compiles, uploads, the caching allocator's blocks
        fn()
        fn()
    log(f"{rounds} rounds of {', '.join(fns)}; {n_tok} tokens at ubatch {ubatch}, device {dev.device}")
    times = rotate(fns, rounds)
    for name, secs in times.items():
        ratios = sorted(a / b for a, b in zip(secs, times["untraced"]))
        q = len(ratios) // 4
        print(f"{name:9s} median {statistics.median(secs):.4f} s; to the same round's untraced: median "
              f"{statistics.median(ratios):.3f}, quartiles {ratios[q]:.3f}-{ratios[-1 - q]:.3f}", flush=True)


if __name__ == "__main__":
    main()
