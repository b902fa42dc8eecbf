"""Where a traced run's GPU sits idle, from a torch.profiler chrome trace (gpu_e2e.py --profile writes one into
$OUT): GPU busy time, idle gaps, and the host calls that ran longest (runtime and driver API, and Python ops).

    python3 benchmarks/trace_gaps.py TRACE.json
"""
import collections
import json
import sys


def main(path):
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not gpu:
        sys.exit(f"{path}: no GPU activity in this trace")
    busy, gaps, end = 0.0, [], None
    for s, f in gpu:
        if end is not None and s > end:
            gaps.append(s - end)
        busy += max(0.0, f - max(s, end or s))
        end = f if end is None else max(end, f)
    span = end - gpu[0][0]
    print(f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, {len(gaps)} gaps, "
          f"sum {sum(gaps) / 1e3:.1f} ms, >50us: {sum(g for g in gaps if g > 50) / 1e3:.1f} ms")
    streams = collections.defaultdict(float)     # kernel time per stream: a side stream's share that overlapped
    for e in ev:
        if e.get("cat") == "kernel":
            streams[e.get("args", {}).get("stream", "?")] += e["dur"]
    print("kernel ms per stream: " + ", ".join(f"{k}: {v / 1e3:.1f}" for k, v in sorted(streams.items(), key=str))
          + f"; their sum less busy (overlapped) {max(0.0, sum(streams.values()) - busy) / 1e3:.1f} ms")
    for cat in ("cuda_runtime", "cuda_driver", "cpu_op"):
        tot = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for e in ev:
            if e.get("cat") == cat:
                t = tot[e["name"]]
                t[0] += 1
                t[1] += e["dur"]
                t[2] = max(t[2], e["dur"])
        print(f"-- {cat}: name, calls, total ms, max us")
        for name, (n, d, m) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:10]:
            print(f"   {name[:60]:60s} {n:6d} {d / 1e3:9.2f} {m:9.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
