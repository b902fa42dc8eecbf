"""The plug-in isolation check's cost per forward pass: the torch way (a copy, `ne` and `any` per input) against the
kernel (`_isolation_kernel.py`: one launch before an op call and one after it, per dtype).

What it checks is a 2.8B layer's plug-in calls at one ubatch, as a device forward pass makes them: ssm_conv
(conv_state, x: a half of in_proj's output, weight) and ssm_scan (ssm_state, x, dt, A, and B, C: slices of
x_proj's output), n_layer times inside one `isolation.deferred()` block, settled with one wait. Both ways must
find a write (checked first), then each is timed: wall time per forward pass (GPU synchronized before and after;
the block ends with the check's own wait) and the host's time to queue it; on a GPU also one call checked alone,
outside a forward pass (a kernel called from a notebook), where the torch way waits for the GPU once per input.

  python3 benchmarks/isolation_bench.py            # a GPU: the 2.8B shape, ubatch 512
  python3 benchmarks/isolation_bench.py --small    # anywhere: a small shape (the kernel interpreted on a CPU)
"""
from __future__ import annotations

import argparse
import statistics
import time

import gpu_common  # noqa: F401  (Triton's mode for the process, the path)
import torch

from mamba_debug import isolation


def _layer_inputs(S: int, T: int, D: int, N: int, R: int, K: int, device) -> tuple:
    xz = torch.randn(S, T, 2 * D, device=device)
    proj = torch.randn(S, T, R + 2 * N, device=device)
    conv = (torch.randn(S, K - 1, D, device=device), xz[..., :D], torch.randn(D, K, device=device))
    scan = (torch.randn(S, D, N, device=device), torch.randn(S, T, D, device=device),
            torch.randn(S, T, D, device=device), torch.randn(D, N, device=device), proj[..., R:R + N],
            proj[..., R + N:])
    return conv, scan


def _forward(layers: list, write: bool = False):
    """One forward pass's checks: each layer's two calls snapshotted, (a write into the last call's x,) queued."""
    with isolation.deferred():
        for conv, scan in layers:
            for args in (conv, scan):
                snap = isolation.snapshot_inputs(args, {})
                if write and args is layers[-1][1]:
                    args[1][0, -1, -1] += 1
                if not isolation.defer(snap, lambda names: f"wrote into {', '.join(names)}"):
                    raise RuntimeError("not deferred: the benchmark needs a GPU or --small")


def _timed(layers: list, sync, reps: int) -> tuple:
    walls, hosts = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        with isolation.deferred():
            inner = time.perf_counter()
            for conv, scan in layers:
                for args in (conv, scan):
                    isolation.defer(isolation.snapshot_inputs(args, {}), str)
            hosts.append(time.perf_counter() - inner)
        sync()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), min(walls), statistics.median(hosts)


def _direct(layers: list, sync, reps: int) -> float:
    """Median seconds of one call's check outside a forward pass (checked at once: the torch way waits per input)."""
    times = []
    for _ in range(reps):
        for conv, scan in layers[:8]:
            for args in (conv, scan):
                sync()
                t0 = time.perf_counter()
                assert not isolation.changed_inputs(isolation.snapshot_inputs(args, {}))
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a small shape (the kernel interpreted without a GPU)")
    ap.add_argument("--reps", type=int, default=0)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = "cuda" if cuda else "cpu"
    isolation.DEFER_ON_CPU = not cuda
    shape = dict(S=1, T=512, D=5120, N=16, R=160, K=4) if cuda else dict(S=2, T=16, D=64, N=16, R=8, K=4)
    n_layer = 64 if cuda else 4
    reps = args.reps or (20 if cuda else 3)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    layers = [_layer_inputs(**shape, device=device) for _ in range(n_layer)]
    torch_way = classmethod(lambda cls, named: None)
    kernel_way = isolation.Fused.__dict__["take"]
    rows = []
    for way, take in (("torch way (copy, ne, any per input)", torch_way), ("kernel (2 launches per call)", kernel_way)):
        isolation.Fused.take = take
        try:
            _forward(layers, write=True)
            raise SystemExit(f"{way}: the write into the last scan's x was not found")
        except isolation.PluginError as e:
            assert "argument 1" in str(e), e
        _forward(layers)                                  # warm: compiled, plans kept
        rows.append((way, *_timed(layers, sync, reps), _direct(layers, sync, reps) if cuda else None))
    isolation.Fused.take = kernel_way
    name = torch.cuda.get_device_name() if cuda else "CPU (kernel interpreted)"
    print(f"\n{name}, {n_layer} layers x (ssm_conv + ssm_scan), {shape}, {reps} forward passes each")
    print(f"{'way':40s} {'wall median':>12s} {'wall min':>10s} {'host queue':>11s}  per call  one call alone")
    for way, med, lo, host, alone in rows:
        print(f"{way:40s} {med * 1e3:9.2f} ms {lo * 1e3:7.2f} ms {host * 1e3:8.2f} ms  "
              f"{med / (2 * n_layer) * 1e6:6.1f} us  " + (f"{alone * 1e6:8.1f} us" if alone else "    (GPU only)"))


if __name__ == "__main__":
    main()
