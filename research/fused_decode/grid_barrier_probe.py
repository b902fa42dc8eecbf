"""H200 probe: does a grid-wide barrier written in Triton (atomic counter + spin) work, and what does one cost?

Each of P programs (P <= SMs, all co-resident) writes a value, passes the barrier, then reads its neighbour's value;
repeated with ROUNDS barriers per launch, eagerly and in a CUDA graph. Prints errors and µs per barrier.
Run: TRITON_INTERPRET=0 python research/fused_decode/grid_barrier_probe.py
(prints the table; writes $OUT/grid_barrier_probe.json when $OUT is set)
"""
import json
import os

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402


@triton.jit
def _barrier(cnt_ptr, n_programs, SPIN_LOAD: tl.constexpr):
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    target = (old // n_programs + 1) * n_programs
    cur = old + 1
    while cur < target:
        if SPIN_LOAD:       # a volatile load polls L2 without taking the atomic unit
            cur = tl.load(cnt_ptr, volatile=True)
        else:
            cur = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    if SPIN_LOAD:           # order the reads after the barrier behind the poll (acquire)
        tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _probe(buf_ptr, out_ptr, cnt_ptr, n_programs, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
           SPIN_LOAD: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    r = 0
    while r < ROUNDS:
        tl.store(buf_ptr + (r % 2) * n_programs * BLOCK + pid * BLOCK + offs, pid * 1000 + r + offs)
        _barrier(cnt_ptr, n_programs, SPIN_LOAD)
        nb = (pid + 1) % n_programs
        v = tl.load(buf_ptr + (r % 2) * n_programs * BLOCK + nb * BLOCK + offs, cache_modifier=".cg")
        tl.store(out_ptr + r * n_programs * BLOCK + pid * BLOCK + offs, v)
        r += 1


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"triton": triton.__version__, "torch": torch.__version__, "sms": sms}
    BLOCK = 128
    for P, rounds, spin in ((sms, 1, 0), (sms, 8, 0), (sms, 1, 1), (sms, 8, 1), (sms // 2, 8, 1), (32, 8, 1)):
        cnt = torch.zeros(1, dtype=torch.int32, device="cuda")   # one counter per grid size (it only grows)
        buf = torch.zeros(2 * P * BLOCK, dtype=torch.int32, device="cuda")
        out = torch.zeros(rounds * P * BLOCK, dtype=torch.int32, device="cuda")
        want = torch.stack([(((torch.arange(P) + 1) % P) * 1000 + r)[:, None] + torch.arange(BLOCK)
                            for r in range(rounds)]).flatten().to(torch.int32).cuda()
        bad = 0
        for _ in range(200):
            out.zero_()
            _probe[(P,)](buf, out, cnt, P, ROUNDS=rounds, BLOCK=BLOCK, SPIN_LOAD=spin, num_warps=4)
            bad += int((out != want).sum())
        torch.cuda.synchronize()
        us = do_bench_cudagraph(lambda: _probe[(P,)](buf, out, cnt, P, ROUNDS=rounds, BLOCK=BLOCK, SPIN_LOAD=spin, num_warps=4)) * 1e3
        bad_graph = int((out != want).sum())
        res[f"P{P}_rounds{rounds}_spinload{spin}"] = {"wrong_elements_200_eager": bad, "wrong_after_graph": bad_graph,
                                       "us_per_launch_graph": round(us, 3)}
        print(P, rounds, res[f"P{P}_rounds{rounds}_spinload{spin}"], flush=True)
    print(json.dumps(res))
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "grid_barrier_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
