"""A second opinion on a borderline first divergence: more float32 samples of the rounding floor.

Why: a site's floor is one sample (float32 against float64) at each token. Where a token's value nearly cancels
(y at a fresh sequence's first token when C . B ~ 0) every float32 implementation errs ~30x its usual relative error,
and one sample of that error is a poor yardstick: the shipped kernels' error landed past 10x it in 3 of 400 random
runs of 5 sequences (research/threshold_conditioning). So when the first divergence's error is within
SECOND_OPINION_BELOW x its threshold, the float32 and float64 references run again on copies of the model whose
float32 weights each moved one float32 ulp, up or down by a seeded hash: the same computation rounded elsewhere,
another sample of the floor at every site and token. The floor becomes the largest sample; thresholds
and the first divergence are found again; the result keeps both answers (`res.second_opinion`).

A Mamba-2 layer's scan has a second legitimate float32 order: the chunked SSD form (mamba_ssm's kernels: a cumulative
sum of δA per chunk, exponentials of its differences), whose rounding is several times the sequential scan's at long
ubatches (research/threshold_conditioning: 13 of 60 random runs of a chunk-256 plug-in read DIVERGED). A plug-in
that computes its scan so declares `SSD_CHUNK = Q`; the last seed's float32 reference then runs that form with
chunks of Q (`ssd_chunk`), and the floor covers both orders. Not by default: the chunked sample raises y's
thresholds ~2.5x at long ubatches, and a 5e-5 bug in y moved 1 to 4 layers later in 5 of 8 such runs with it.
Only the torch engine: llama.cpp's verdict recomputes each node in float32 by other means
(`sides.llamacpp.precision`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .arch import model_ops
from .budget import available_host_bytes
from .errors import MambaDebugError
from .model import Model, once_per_tensor
from .trace import CompareResult, find_first_divergence, thresholds_from_floor

SECOND_OPINION_BELOW = 100.0    # a first divergence with error <= this x its threshold is re-judged
SEEDS = (1, 2)                  # one nudged copy of the model per seed: two more samples of every floor
# 11 of 150 clean runs (random settings of the shipped model, 1 to 5 sequences) had a site past 0.4x its threshold:
# 0.42-0.78x with the run's own sample, at most 0.26x with one more, 0.23x with two (docs/design-notes.md).


def wanted(res: CompareResult) -> bool:
    """Whether the result's first divergence is close enough to its threshold for rounding to explain it: a finite
    error within SECOND_OPINION_BELOW x the threshold, from the torch engine's own verdict (not llama.cpp's)."""
    fd = res.first_divergence
    return (fd is not None and not fd["nan"] and not res.judged and res.settings.engine == "torch"
            and fd["error"] <= SECOND_OPINION_BELOW * fd["threshold"])


def ssd_chunk(config, seed: int, declared: Optional[int]) -> Optional[int]:
    """The chunk size of the chunked SSD form that seed's float32 reference runs Mamba-2's scan in: the plug-in's
    declared SSD_CHUNK for the last seed of a model with an ssd_scan, else None (the sequential scan)."""
    return declared if declared and seed == SEEDS[-1] and "ssd_scan" in model_ops(config) else None


def nudged(model: Model, seed: int, device: Optional[torch.device] = None) -> Model:
    """A copy of the model whose every master moved by one float32 ulp (up or down in magnitude by a hash of the
    value and the seed; zeros and the largest float stay), so the float32 and float64 references both read the moved
    values and their difference is rounding again, elsewhere. A master that holds float32 values moves to the next
    float32 value and is kept as a float32 tensor (half the memory of a float64 one; every back-end casts it
    exactly); one that does not (A = -exp(A_log) computed in float64, weights built in float64) moves by a relative
    2^-24 in its own dtype. Tied tensors stay tied; the model itself is not touched.

    device: the GPU the references run on. The float32 masters are then moved there from the references' own float32
    copy and stay there: a 2.8B model's masters moved on its 16-core host took ~10 s a copy, most of it moving 22 GB
    of float64 values between host and GPU."""
    if device is None:
        check_copy_fits(model)
        src = model.params
    else:
        narrow, wide = model.float32_on(device)
        src = {k: v if k in wide else narrow[k] for k, v in model.params.items()}     # tied names: one tensor
    return Model(model.config, once_per_tensor(src, lambda v: _moved(v, seed)), model.tokenizer,
                 source=model.source, notes=model.notes)


CHUNK = 1 << 24                 # elements a step: the temporaries stay small (a 2.8B model's page faults were most
                                # of a sample's time when whole tensors were copied)
_HASH = -1640531535             # 0x9E3779B1 as an int32: the multiply's top bit depends on every bit of the value


def _moved(v: torch.Tensor, seed: int) -> torch.Tensor:
    """v moved by one float32 ulp per element, on v's device: a float32 tensor of the neighbouring float32 values
    where v holds float32 values, else v's dtype scaled by 1 +- 2^-24."""
    flat = v.detach().reshape(-1)
    parts = [flat[a:a + CHUNK] for a in range(0, flat.numel(), CHUNK)]
    narrow = all(torch.equal(p.to(torch.float32).to(p.dtype), p) for p in parts)
    out = torch.empty(flat.shape, dtype=torch.float32 if narrow else flat.dtype, device=flat.device)
    salt = seed * 0x2545F49 & 0x7FFFFFFF
    for a, part in zip(range(0, flat.numel(), CHUNK), parts):
        w = part.to(torch.float32)
        bits = w.view(torch.int32)
        # +1 or -1: one ulp away from or toward zero, by the hash's sign
        step = (bits ^ salt).mul_(_HASH).bitwise_right_shift_(31).bitwise_or_(1).neg_()
        mag = bits & 0x7FFFFFFF
        step.mul_((mag != 0) & (mag < 0x7F7FFFFF))     # zeros and the largest float stay (no sign flip, no inf)
        out[a:a + CHUNK] = (bits + step).view(torch.float32) if narrow else part * (1 + step.to(part.dtype) * 2**-24)
    return out.view(v.shape)


def merge(res: CompareResult, samples: list, seeds: tuple = SEEDS, chunked_ssd: Optional[int] = None,
          mamba2: bool = False) -> None:
    """Judge again with each site's floor the largest of its samples (the run's own and `samples`: floor dicts of
    the nudged runs, the same keys and shapes); record the first answer in `res.second_opinion`. chunked_ssd: the
    chunk size of a sample whose Mamba-2 scan ran in the chunked SSD form (None: every sample sequential); mamba2:
    the model has one (the record then says `chunked_ssd` either way)."""
    before, first = res.first_divergence, res.thresholds
    res.floor = {k: torch.stack([f] + [s[k] for s in samples]).amax(0) for k, f in res.floor.items()}
    # more samples never lower a threshold: a token whose larger sample crosses OUTLIER x the median leaves the site's
    # level (judged by its own floor), which alone would lower the others' threshold
    res.thresholds = {k: max(v, first[k]) for k, v in thresholds_from_floor(res.floor, res.settings.k_floor).items()}
    res.first_divergence = find_first_divergence(res)
    res.second_opinion = {"taken": True, "samples": len(samples), "seeds": list(seeds),
                          "below": SECOND_OPINION_BELOW, "first_divergence_before": before,
                          "confirmed": res.first_divergence is not None,
                          **({"chunked_ssd": chunked_ssd} if mamba2 else {})}


def not_taken(res: CompareResult, why: str) -> None:
    """The second opinion was wanted and could not run (memory): the first answer stands, and says so."""
    res.second_opinion = {"taken": False, "why": why, "below": SECOND_OPINION_BELOW,
                          "first_divergence_before": res.first_divergence, "confirmed": None}


def take(res: CompareResult, floors_of: Callable[[int], dict], config, declared: Optional[int] = None) -> bool:
    """Run the second opinion when `wanted` (True when it was): floors_of(seed) -> the floors of the model (config)
    nudged by that seed (compare's loop over the same tokens, schedule and generated tokens; the last seed's Mamba-2
    scan chunked where the plug-in declares it, `ssd_chunk`). A budget check refusing a
    sample run leaves it `not_taken`, saying why."""
    if not wanted(res):
        return False
    samples = []
    for seed in SEEDS:
        try:
            samples.append(floors_of(seed))
        except MambaDebugError as e:            # the nudged copy or its run does not fit
            not_taken(res, str(e))
            return True
    merge(res, samples, chunked_ssd=ssd_chunk(config, SEEDS[-1], declared), mamba2="ssd_scan" in model_ops(config))
    return True


def check_copy_fits(model: Model) -> None:
    """Refuse (a MambaDebugError, so the second opinion is not taken) a nudged copy of the masters that could take
    more than half the host memory available now (counted in the masters' dtype: float32 values take half of it)."""
    need = sum(v.numel() * v.element_size() for v in {id(v): v for v in model.params.values()}.values())
    have = available_host_bytes()
    if need > 0.5 * have:
        raise MambaDebugError(f"a nudged copy of the weights needs {need / 1e9:.1f} GB of host memory, "
                              f"{have / 1e9:.1f} GB available")


def words(res: CompareResult) -> Optional[str]:
    """One sentence on the second opinion for the summary and the verdict, or None when none was wanted."""
    so = res.second_opinion
    if not so:
        return None
    b = so["first_divergence_before"]
    at = f"token {b['token']} (seq {b['seq']}), {_where(b)} '{b['site']}' at {b['error'] / b['threshold']:.2g}x"
    if not so["taken"]:
        return f"second opinion not taken ({so['why']}): the first answer, {at} its threshold, stands"
    q = so.get("chunked_ssd")
    more = (f"{so['samples']} more float32 samples of the floor (the weights moved one ulp"
            + (f"; one with Mamba-2's scan in the chunked SSD form, Q={q}, as the plug-in declares)" if q else ")"))
    if not so["confirmed"]:
        why = "at an ill-conditioned token or of the chunked scan's order" if q else "at an ill-conditioned token"
        return f"{at} its threshold was re-judged against {more}: rounding {why}, not a divergence"
    now = res.first_divergence
    if now is not None and (now["token"], now["seq"], now["layer"], now["site"]) != \
            (b["token"], b["seq"], b["layer"], b["site"]):
        return f"{at} its threshold was within {more}; the verdict's divergence is past them too"
    # within reach of a chunked scan's rounding (a chunk-256 plug-in reached 6.7x with sequential samples alone)
    near = now is not None and now["error"] <= 10 * now["threshold"]
    hint = ("; a plug-in whose ssd_scan is chunked declares SSD_CHUNK to have that order sampled too"
            if "chunked_ssd" in so and not q and near else "")
    return f"confirmed against {more} (first seen: {at} its threshold){hint}"


def _where(fd: dict) -> str:
    return f"layer {fd['layer']}" if fd["layer"] is not None else "the output head"
