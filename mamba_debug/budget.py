"""Memory a comparison needs, estimated before anything runs, and the refusals that follow from it.

Every estimate counts the per-site sizes the layer types declare (`arch.site_elements`); tests check them against
a real kept trace to the byte.
"""
from __future__ import annotations

import ctypes
import math
from typing import Callable, Optional

import torch

from .arch import layer_site_elements, layer_sites, layer_type, param_shapes, site_elements, working_elements
from .config import ModelConfig
from .errors import MambaDebugError
from .settings import RunSettings

FITTING_UBATCHES = (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)


def ubatch_capture_bytes(cfg: ModelConfig, ubatch: int, n_seqs: int = 1) -> int:
    """Bytes of one ubatch of captured sites for the three runners (device and ref32 float32, ref64 float64): every
    layer site, the per-token SSM states included, and the head. They are held until the ubatch's metrics are taken,
    so with capture='metrics' this, not the prompt length, is what a comparison's working memory grows with."""
    el = site_elements(cfg)
    per_token = sum(sum(layer.values()) for layer in layer_site_elements(cfg)) + el["final_norm"] + el["logits"]
    at_end = sum(math.prod(spec.shape(cfg)) for spec in _end_states(cfg))
    return n_seqs * (ubatch * per_token + at_end) * (4 + 4 + 8)


def _end_states(cfg: ModelConfig) -> list:
    """The states taken at ubatch ends only (not per token), over every layer."""
    return [spec for i in range(cfg.n_layer) for spec in layer_type(cfg, i).states if not spec.per_token]


def _stored_elements(cfg: ModelConfig) -> dict:
    """Elements of each weight as stored: a tied head is the embedding's tensor, so it is left out."""
    return {k: math.prod(v) for k, v in param_shapes(cfg).items() if not (k == "lm_head" and cfg.tie_embeddings)}


def comparison_gpu_bytes(cfg: ModelConfig, ubatch: int, n_seqs: int, n_tok: int,
                         wide_elements: Optional[int] = None, ubatch_seqs: Optional[int] = None) -> int:
    """GPU bytes of a comparison whose reference sides run on the GPU. Weights: the device's float32 copy, the float32
    references' copy (which the float64 reference shares for every weight that is a float32 value) and a float64 copy
    of the `wide_elements` that are not (None: all of them, the bound before the weights are looked at); while the
    float64 reference runs a block or the head, that block's weights widened. One ubatch of captured sites for the
    three runners, the float64 working memory of the reference runs and metrics (`arch.working_elements`, measured
    per layer type), attention's KV caches in each runner, and the logits kept for perplexity. Within 1% of the
    peaks of a 2.8B Mamba-1 at ubatch 64-256, within 4% of a Mamba-2's (a 2.7B's at ubatch 16 and 32 on an
    H100: 39.0 and 53.4 GB, 4.1-4.4% over it) and a hybrid's (tests/test_engine.py).
    ubatch: tokens of each sequence in one ubatch; ubatch_seqs: the sequences one ubatch holds (None: all n_seqs)."""
    seqs = n_seqs if ubatch_seqs is None else ubatch_seqs
    stored = _stored_elements(cfg)
    params = sum(stored.values())
    wide = params if wide_elements is None else wide_elements
    block = max(sum(n for k, n in stored.items() if k.startswith(f"layers.{i}.")) for i in range(cfg.n_layer))
    widened = 8 * (block + max(stored.values()))
    working = seqs * ubatch * working_elements(cfg) * 8
    logits = 2 * n_seqs * n_tok * cfg.vocab_size * 4
    return params * (4 + 4) + wide * 8 + widened + ubatch_capture_bytes(cfg, ubatch, seqs) + working \
        + cache_bytes(cfg, n_seqs, n_tok) + logits


def cache_bytes(cfg: ModelConfig, n_seqs: int, n_tok: int) -> int:
    """The states that grow a row a token (attention's KV caches) over every layer, in the three runners."""
    grown = [spec for i in range(cfg.n_layer) for spec in layer_type(cfg, i).states if spec.grows]
    return n_seqs * n_tok * sum(math.prod(spec.shape(cfg)[1:]) for spec in grown) * (4 + 4 + 8)


def _ubatch_split(s: RunSettings, n_tok: int) -> tuple:
    """(tokens of each sequence, sequences) in one ubatch: -ub counts tokens across the sequences, and llama.cpp's
    equal split puts at most -ub + 1 sequences in one (`RunSettings.seqs_per_ubatch`)."""
    return min(s.ubatch_per_seq(), n_tok), s.seqs_per_ubatch()


def check_gpu_memory(cfg: ModelConfig, s: RunSettings, n_tok: int, total_bytes: Optional[float] = None,
                     count_wide: Optional[Callable[[], int]] = None):
    """Refuse, before anything is uploaded, a ubatch whose GPU working set would not fit (reference sides on the GPU).
    count_wide: how many weight elements are not float32 values (a pass over the weights, taken only when the bound
    that counts all of them as such does not fit)."""
    if s.ref_device != "cuda":
        return
    if total_bytes is None:
        total_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def need(u: int, wide: Optional[int]) -> int:
        ub, seqs = _ubatch_split(s.replace(ubatch=u), n_tok)
        return comparison_gpu_bytes(cfg, ub, s.n_seqs, n_tok, wide, ubatch_seqs=seqs)
    wide = None
    if need(s.ubatch, None) > 0.9 * total_bytes and count_wide is not None:
        wide = count_wide()
    if need(s.ubatch, wide) <= 0.9 * total_bytes:
        return
    fits = next((u for u in FITTING_UBATCHES if u < s.ubatch and need(u, wide) <= 0.9 * total_bytes), None)
    fix = f"use --ubatch {fits} (about {need(fits, wide) / 1e9:.0f} GB)" if fits \
        else "the weights alone do not fit: use --ref-device cpu"
    raise MambaDebugError(f"with the reference sides on the GPU, ubatch {s.ubatch} needs about "
                          f"{need(s.ubatch, wide) / 1e9:.0f} GB of GPU memory (weights in float32 and float64, every "
                          f"site of one ubatch for the three runners), over 90% of the {total_bytes / 1e9:.0f} GB "
                          f"there: {fix}")


def check_budget(cfg: ModelConfig, s: RunSettings, n_tok: int):
    """The kept trace (host memory): both sides of every kept site, the device's float32 and the reference side's
    float32 (ref32, the default) or float64 (reference='float64'), counted with the per-site sizes of
    ubatch_capture_bytes (tests/test_engine.py checks the estimate against a kept trace)."""
    if s.capture == "metrics":
        return
    el = site_elements(cfg)
    layers = len(s.capture_layers) if s.capture_layers else cfg.n_layer
    sites = [x for x in layer_sites(cfg) if not s.capture_sites or x in s.capture_sites]
    per_tok = layers * sum(el[x] for x in sites) + el["final_norm"] * (not s.capture_sites) + el["logits"]
    mb = (4 + (8 if s.reference_is_float64 else 4)) * s.n_seqs * n_tok * per_tok / 2**20
    if mb > s.memory_budget_mb:
        raise MambaDebugError(
            f"capturing every site would keep about {mb:.0f} MB of tensors, over the {s.memory_budget_mb:.0f} MB "
            f"budget: use capture='metrics' (metrics only), or capture='sites' with fewer layers/sites, or raise "
            f"the budget (--memory-budget-mb)")


# glibc keeps freed blocks of the reference sides' threads (malloc_trim gave 0.4-2.5 GB back after a run on the
# 2-core machine): without this, small runs peaked at up to 2.6x the rest of the estimate (benchmarks/README.md,
# thirtieth session)
ALLOCATOR_SLACK = 0.75e9


def host_bytes(cfg: ModelConfig, s: RunSettings, n_tok: int) -> int:
    """Host memory a comparison with the reference sides on the CPU adds to a process that holds the model: float32
    copies of the weights (a tied tensor once) for the float32 reference and, unless it runs on the GPU, the device
    (the float64 masters are loaded already, so the memory available no longer counts them, and the float64 reference
    runs on them); one ubatch of sites for the three runners (twice: the runners' temporaries); the logits kept for
    perplexity; the metrics of every site and token; attention's KV caches; the allocator's slack. Measured on the
    2-core machine (16-32 layers, d_model 512-1024, ubatch 8-128, 1 and 4 sequences): the peak RSS a run added was
    0.65-1.10x this."""
    params = sum(_stored_elements(cfg).values())
    ub, seqs = _ubatch_split(s, n_tok)
    n_sites = sum(len(x) for x in layer_site_elements(cfg)) + 2
    metrics = s.n_seqs * n_tok * n_sites * 8 * 6
    device_copy = 0 if s.device == "cuda" else 4          # the device side's own float32 weights (isolation)
    return params * (4 + device_copy) + 2 * ubatch_capture_bytes(cfg, ub, seqs) + 2 * s.n_seqs * n_tok * \
        cfg.vocab_size * 8 + metrics + cache_bytes(cfg, s.n_seqs, n_tok) + int(ALLOCATOR_SLACK)


def workers_that_fit(cfg: ModelConfig, s: RunSettings, n_tok: int, available: Optional[float] = None) -> int:
    """Sweep worker processes the host memory holds: each loads the float64 masters again (a tied tensor once) and
    runs its cells (`host_bytes` of `s`, the grid's largest cell); the parent's copy is counted by the memory
    available already. At least one (that one runs in the parent's memory, and `check_host_memory` judges it)."""
    available = _available_host_bytes() if available is None else available
    masters = 8 * sum(_stored_elements(cfg).values())
    return max(1, int(0.8 * available // (masters + host_bytes(cfg, s, n_tok))))


def _available_host_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return math.inf


def available_host_bytes() -> float:
    """The host memory available now (MemAvailable; inf where /proc/meminfo is not there)."""
    return _available_host_bytes()


def give_back_freed_heap() -> None:
    """Hand the pages of freed blocks that glibc keeps back to the system (`malloc_trim`), else a process holds them
    after a run and the next run's host check (MemAvailable) counts them as used: a 16-layer d_model 512 comparison on
    the 2-core machine left 0.87 GB, 0.21 GB after this (30 ms; the next run not measurably slower). No-op where the
    C library has no malloc_trim."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _libc():
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):            # no C library to open by that name (Windows)
        return None


def check_host_memory(cfg: ModelConfig, s: RunSettings, n_tok: int, available: Optional[float] = None):
    """Refuse, within seconds, a run whose host working set would not fit, with the figure and settings that fit."""
    if s.ref_device != "cpu":
        return
    available = _available_host_bytes() if available is None else available
    need = host_bytes(cfg, s, n_tok)
    if need <= 0.8 * available:
        return
    fit = lambda **kw: host_bytes(cfg, s.replace(**kw), n_tok) <= 0.8 * available  # noqa: E731
    seqs = next((n for n in (4096, 1024, 256, 64, 16, 4, 1) if n < s.n_seqs and fit(n_seqs=n)), None)
    ubs = next((u for u in FITTING_UBATCHES if u < s.ubatch and fit(ubatch=u)), None)
    fixes = [f"--n-seqs {seqs}" for _ in [0] if seqs] + [f"--ubatch {ubs}" for _ in [0] if ubs]
    fix = " or ".join(fixes) if fixes else "a shorter prompt or fewer --n-gen tokens"
    raise MambaDebugError(f"this run needs about {_human(need)} more memory (n_seqs {s.n_seqs}, ubatch {s.ubatch}, "
                          f"{n_tok} tokens), over 80% of the {_human(available)} available: use {fix}")


def _human(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
