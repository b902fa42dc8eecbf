"""Where the prefill scan's warps wait: kernels/triton.py's ssm_scan under Nsight Compute, default plans.

Launches the scan twice per shape to compile and warm it, then once more with `torch.cuda.profiler` around it; run
under ncu so that only that launch (its pass 1 and pass 2 for a chunked plan) is profiled:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section SchedulerStats --section WarpStateStats -k regex:_ssm_scan_kernel \
        python3 research/scan_rows/ncu_scan.py [S ...]          # batch sizes, default 1 8

(d_inner 5120, L 2048, d_state 16, fp32: the shapes of goal 4.) Without ncu it only runs the launches.
"""
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import torch  # noqa: E402

from h200 import scan_inputs  # noqa: E402
from mamba_debug.plugins import load_plugin  # noqa: E402

mod = load_plugin("triton", device="cuda").module
for S in [int(a) for a in sys.argv[1:]] or [1, 8]:
    args = scan_inputs(S, 2048, 5120)
    for _ in range(2):
        mod.ssm_scan(*args)
    torch.cuda.synchronize()
    print(f"batch {S}: plan {mod.scan_plan(S, 2048, 5120, 16, device=args[1].device)}", flush=True)
    torch.cuda.profiler.start()
    mod.ssm_scan(*args)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
