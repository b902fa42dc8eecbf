"""kernels/triton.py's launch parameters: how `ssm_conv` and `ssm_scan` cut their work, by device and size.

Not a plug-in (the leading underscore keeps it off the list): kernels/triton.py executes it and re-exports
`scan_plan` (benchmarks call it to see the default plan). A file of its own so that triton.py has room below the
500-line cap for its launchers' host work.
"""
import os

from mamba_debug.triton_launch import cdiv as _cdiv, next_pow2 as _pow2, sm_count

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The one place that differs between the GPU and the interpreter. Block sizes change speed, not the arithmetic:
# every output element is the same sum in the same order whatever the blocks are. Two exceptions, both rounding
# only: compiled, the scan's sum over N may be split across threads differently for other blocks or strides; and
# a scan cut into time chunks carries the state chunk to chunk (P h + E) instead of token to token.

def conv_config(S: int, T: int, D: int, device=None) -> dict:
    """Block sizes and warps of ssm_conv on an [S, T, D] input.

    Interpreter: each program instance costs a large fixed Python overhead (a 64-token scan at D=512 took
    2.2 s with 64-channel blocks, 0.3 s with one 512-channel block), so use as few programs as possible."""
    if INTERPRET and T == 1:    # decode: the one-token kernel, sequences and channels in one block (<= 2**20)
        return dict(schedule="one_token", BLOCK_S=min(_pow2(S), max(1, 2 ** 18 // _pow2(D))), BLOCK_D=_pow2(D),
                    num_warps=1)
    if INTERPRET:
        block_d = min(_pow2(D), 1024)
        block_t = min(_pow2(T), max(1, 2 ** 16 // block_d))   # tiles up to 64K elements
        return dict(BLOCK_D=block_d, BLOCK_T=block_t, num_warps=1)
    # Long prompts: 64 channels x 32 tokens x the K taps, 4 warps, the best of 108 plans on an H200 (26.0 us at
    # d_inner 5120, L 2048, batch 1; benchmarks/results/h200_tuning_run1.json, now in git history). Short ubatches
    # and decode keep 128-channel rows (1.6 us per decode step at batch 1).
    block_d, block_t = (64, 32) if T >= 32 else (128, _pow2(T))
    return dict(BLOCK_D=block_d, BLOCK_T=block_t, num_warps=max(1, min(4, block_d * block_t * 4 // 512)))


# Tokens per tile of the interpreter's prompt schedule: larger tiles pay the per-tile operations fewer times (a
# 64-token scan at d_inner 256: 41-44 ms with one 64-token tile, 47-50 ms with four of 16).
TILE_T_MAX = 64


# A chunk of the GPU scan is never shorter than this many tokens: shorter chunks add carry work (and a second
# exp per token) for parallelism that is already there.
MIN_CHUNK_T = 64


def scan_plan(S: int, T: int, D: int, N: int, device=None) -> dict:
    """How ssm_scan runs an [S, T, D] x N problem: the schedule, its blocks and, on a GPU, the time chunks.

    Interpreter (kernels/_triton_interpret.py): one token, one program per sequence; more, the tiled schedule,
    one program for up to 1024 channels, up to TILE_T_MAX tokens prepared at once.
    GPU: the step schedule with small channel blocks; when S * D / BLOCK_D programs cannot fill the SMs a few
    times over (a long prompt at batch 1), the prompt is also cut into chunks that run in parallel."""
    block_n = _pow2(N)
    if INTERPRET and T == 1:    # decode (ubatch 1): one step, one program per sequence
        return dict(schedule="one_token", BLOCK_D=_pow2(D), n_chunks=1, num_warps=1)
    if INTERPRET:
        return dict(schedule="tiled", BLOCK_D=min(_pow2(D), 1024), n_chunks=1, TILE_T=min(_pow2(T), TILE_T_MAX),
                    num_warps=1)
    sms = sm_count(device)
    if T < 4:
        # decode: the largest channel block that still gives about two programs per SM (1.7 us per decode step at
        # batch 1, 11.4 us at batch 64 on an H200)
        block_d = next((b for b in (64, 32) if S * _cdiv(D, b) >= 2 * sms), 16)
        return dict(schedule="steps", BLOCK_D=block_d, n_chunks=1, SLOTS=1, TILES=False,
                    num_warps=max(1, min(8, block_d * block_n // 512)))
    # Prompts (research/scan_rows/: plans timed on an H200 on 2026-12-02): one-warp programs of 32 channels, four
    # tokens in flight (eight in one pass, below). Short ubatches, and many sequences (which fill the GPU on their
    # own), run in one pass; a long prompt of a few sequences is also cut into chunks, up to 30 programs per SM (two
    # waves at most: a chunk's walk is long, the wave's tail short). At d_inner 5120: L 2048 batch 8 in one pass
    # 845 us (1102 before); batch 1, 24 chunks 166 us (188); L 8192 600 us (722). d_inner 1536, L 2048, 32 chunks
    # 64 us (86).
    # One pass over MIN_CHUNK_T tokens or more keeps eight tokens in flight (127 registers: still four warps a
    # scheduler; H100, 2026-12-06, research/scan_rows/lead.py: L 2048 batch 8 743 us against 853, batch 4 562
    # against 703, 64 tokens x batch 64 155 against 172). Chunked plans keep four in pass 2 (133 registers, a warp
    # a scheduler fewer: batch 1 171 us against 167) and take eight in pass 1 (128 registers; H100, 2026-12-06,
    # thirty-fourth session: 1-12% faster at every chunked shape timed, batch 1 x 2048 163.5 us against 167.3).
    programs = S * _cdiv(D, 32)
    n_chunks = 1 if programs >= 4 * sms else max(1, min(T // MIN_CHUNK_T, 30 * sms // programs))
    if n_chunks > 1:
        return dict(schedule="steps", BLOCK_D=32, n_chunks=n_chunks, SLOTS=4, SLOTS_PASS1=8, TILES=True, num_warps=1)
    return dict(schedule="steps", BLOCK_D=32, n_chunks=1, SLOTS=8 if T >= MIN_CHUNK_T else 4, TILES=True, num_warps=1)
