"""Blind spot: one near-zero y_scan token (token 0 of a later sequence) sets layer 1's threshold for the whole run,
so a 1e-4 bug in y (bug_y_scaled.py) is reported at the wrong layer with 3 sequences. Run from the repository root:
    python research/threshold_conditioning/repro_blind_token.py"""
from pathlib import Path

import mamba_debug as md
from mamba_debug.io import DATA_DIR

HERE = Path(__file__).parent
m = md.load_model()
ids = m.encode((DATA_DIR / "tiny-mamba" / "val.txt").read_text()[:4000])[:300]
for ns in (1, 3):
    res = md.run_compare(m, ids, md.RunSettings(device="cpu", kernels=str(HERE / "bug_y_scaled.py"), offload=11,
                                                ubatch=512, n_seqs=ns, n_gen=2))
    e, f, thr = res.errors[(1, "y_scan")]["rel_l2"], res.floor[(1, "y_scan")], res.thresholds[(1, "y_scan")]
    print(f"n_seqs={ns}: {md.verdict(res)}")
    print(f"   layer 1 y_scan: floor median {float(f.median()):.2g}, max {float(f.max()):.2g}; threshold {thr:.3g}")
