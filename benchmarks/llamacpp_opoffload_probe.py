"""Probe (issue #14): at -ngl 0 on a CUDA build, op offload runs big matmuls on CUDA while the SSM ops stay on the
CPU. The 2.8B shape then read 'DIVERGED at layer 0 y_scan' (0.917) with logits fine. This prints, for small models
of that width, the verdict and layer 0's node map (name, op, backend, site) to find the mapping at fault."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import mamba_debug as md  # noqa: E402
from mamba_debug.compare import run_compare  # noqa: E402
from mamba_debug.config import MambaConfig  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.views.summary import to_json  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_e2e import mamba_ssm_params  # noqa: E402

for d_model, n_tok in ((2560, 40), (256, 40), (2560, 8)):
    cfg = MambaConfig(d_model=d_model, n_layer=2, vocab_size=512, d_state=16, d_conv=4, expand=2)
    gguf = md.export_gguf(md.build_model(cfg, mamba_ssm_params(cfg, 0, "cuda"), source="probe"),
                          Path(f"/tmp/probe-{d_model}.gguf"), dtype="f32")
    model = md.load_model(gguf)
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(n_tok)]
    for ngl in (0, 3):
        res = run_compare(model, ids, RunSettings(engine="llama.cpp", device="cuda", offload=ngl, ubatch=512,
                                                  n_gen=1, reference="float64", capture="metrics", local=True,
                                                  llama_lib=str(ROOT / "build/llama-cuda/bin")))
        j = to_json(res)
        print(f"\n== d_model {d_model}, {n_tok} tokens, ngl {ngl}: {j['verdict']}")
        for n in j["config"]["llama_cpp"].get("nodes", []):
            if n.get("layer") == 0 and n.get("ubatch", 0) == 0:
                print("   ", {k: n.get(k) for k in ("index", "name", "op", "backend", "site", "ne", "path")})
