"""False alarm 2: a Mamba-2 scan in mamba_ssm's chunked form (ssd_chunk_mamba_ssm.py) reads DIVERGED on the shipped
hybrid at ubatch 512 unless it declares SSD_CHUNK (it does since the thirty-ninth session: then clean, and without the
declaration the first line below reads DIVERGED); the stable-segment-sum control and the sequential scan read clean.
Run from the repository root:
    python research/threshold_conditioning/repro_chunked_ssd.py"""
from pathlib import Path

import mamba_debug as md
from mamba_debug.io import DATA_DIR

HERE = Path(__file__).parent
m = md.load_model("tiny-granite-hybrid")
ids = m.encode((DATA_DIR / "tiny-mamba" / "val.txt").read_text()[:200000])[:256]
for name in ("ssd_chunk_mamba_ssm.py", "ssd_chunk_stable_seg.py", "ssd_sequential.py"):
    res = md.run_compare(m, ids, md.RunSettings(device="cpu", kernels=str(HERE / name), offload=m.config.n_layer,
                                                ubatch=512, n_gen=0))
    print(name, "->", md.verdict(res))
