"""Side-by-side traced runs: every side sees the same tokens, one ubatch at a time.

The prompt, then the reference's greedy continuation for n_gen tokens (teacher forcing, so the states stay
comparable after a token flips), in llama.cpp's ubatches. The sides go in lock step: `ref32` (float32 torch ops),
`ref64` (float64) and `device` (host blocks below the boundary, device kernels from it on); `repeat` (a second
device run: nondeterminism) and `local` (each device block on the reference's inputs) when asked. The reference side
is ref32 (default) or ref64. The float32-vs-float64 spread of the reference on the same input is the *noise floor* of
every site: a site diverges when its error exceeds k_floor times its floor (trace.thresholds_from_floor).

`ref_device="cuda"` runs ref32, ref64 and the host blocks with the same plain torch ops on the GPU (for big models).
Their tensors then stay on the GPU, the metrics are computed there, and only the metrics (and the kept trace, per the
capture policy) come to the host. Memory: every site of every layer of one ubatch is held for the three runners until
its metrics are taken (`budget.ubatch_capture_bytes`), so the ubatch size bounds it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from .arch import model_ops
from .backends import cpu_backend, cpu_threads_for, declared_ssd_chunk, device_backends, reference_backend
from .budget import check_budget, check_gpu_memory, check_host_memory, give_back_freed_heap
from .budget import comparison_gpu_bytes, ubatch_capture_bytes  # noqa: F401 (their home before the restructure)
from .errors import MambaDebugError
from .gc_scope import young_only
from .model import Model, Runner, check_tokens, prompt_list, require_model
from .settings import K_FLOOR, RunSettings, as_settings, resolve_ref_device
from .settings import CAPTURE_POLICIES, CompareSettings  # noqa: F401 (importable from here, as before)
from .accumulate import Accumulator, merge_groups
from . import second_opinion
from .refcheck import check_float32_range, check_reference
from .sides.base import SharedReference
from .sides.torch_side import TorchSide
from .trace import CompareResult, SideInfo, TokenInfo, find_first_divergence, thresholds_from_floor
from .trace import MIN_FLOOR  # noqa: F401 (importable from here, as before)


def sequence_prompts(ids: list, n_seqs: int, vocab_size: int) -> torch.Tensor:
    """S different prompts of equal length from one: identical sequences would hide state-slot bugs."""
    base = torch.tensor(ids, dtype=torch.long)
    rows = [base]
    for s in range(1, n_seqs):
        rolled = torch.roll(base, -s)
        rows.append(rolled if not torch.equal(rolled, base) else (base + 7 * s) % vocab_size)
    return torch.stack(rows)


def run_compare(model: Model, prompt_ids, settings: Optional[RunSettings] = None,
                progress=None, ref_cache: Optional[dict] = None) -> CompareResult:
    """Run every side over the prompt plus n_gen teacher-forced tokens; see the module docstring.

    ref_cache: a dict shared by runs that differ only in offload/kernels/device (a sweep): the reference
    sides do not depend on them, so they are computed once and read back from the cache.
    """
    require_model(model, "run_compare")
    cfg = model.config
    s = as_settings(settings, "run_compare").validated(cfg)
    placement = s.placement(cfg.n_layer)
    tokens = check_tokens(sequence_prompts(prompt_list(prompt_ids), s.n_seqs, cfg.vocab_size), cfg.vocab_size)
    check_budget(cfg, s, tokens.shape[1] + s.n_gen)
    check_host_memory(cfg, s, tokens.shape[1] + s.n_gen)
    ref_device = resolve_ref_device(s.ref_device)
    if ref_device.type == "cuda":
        check_gpu_memory(cfg, s, tokens.shape[1] + s.n_gen, count_wide=model.wide_elements)
    t0 = time.perf_counter()
    groups = s.seq_groups(tokens.shape[0])
    shared = lambda a, b: SharedReference(_cache_for(ref_cache, model, tokens[a:b], s))  # noqa: E731
    with young_only():          # no full garbage collections over the old heap mid-run (~150 ms each)
        sides = build_sides(model, s, placement, ref_device, shared(*groups[0]))
        try:
            res = _run_sides(model, s, sides, tokens, placement, groups, shared, progress)
        finally:
            close = getattr(sides["device"], "close", None)     # an engine's context and model (llama.cpp)
            if close is not None:
                close()
            del sides
            if ref_cache is None:       # not a sweep's cell (a sweep keeps its reference sides for the next)
                give_back_freed_heap()
        t1 = time.perf_counter()
        declared = declared_ssd_chunk(s.kernels, s.device) if s.engine == "torch" else None
        floors_of = lambda seed: _nudged_floors(model, seed, s, tokens, res.tokens, ref_cache, declared)  # noqa: E731
        if second_opinion.take(res, floors_of, cfg, declared):
            res.timings["second_opinion_s"] = time.perf_counter() - t1
    res.timings["compare_s"] = time.perf_counter() - t0
    return res


def _run_sides(model: Model, s: RunSettings, sides: dict, tokens: torch.Tensor, placement, groups: list, shared,
               progress, forced: Optional[torch.Tensor] = None) -> CompareResult:
    """The comparison itself: every group of sequences through every side in lock step, then the verdict.
    forced: [S, P + G] tokens to generate instead of the reference's choices (a second opinion's runs)."""
    cfg, dev = model.config, sides["device"]
    layer_sites = dev.layer_sites() if hasattr(dev, "layer_sites") else [lt.sites for lt in dev.runner.layer_types]
    res = CompareResult(settings=s, model_info={"source": model.source, **cfg.to_dict(),
                                                  **({"notes": model.notes} if model.notes else {})},
                        placement=placement,
                        sides={k: v.info for k, v in sides.items() if k in ("ref32", "ref64", "device")},
                        layer_sites=layer_sites, tokens=tokens, n_prompt=tokens.shape[1], token_info=[])
    res.observed = {k: sides[k].observed_sites() for k in res.sides}
    with cpu_threads_for(cfg):
        parts = []
        for i, (a, b) in enumerate(groups):     # one group unless -ub + 1 < n_seqs (llama.cpp's split, see settings)
            if i:                               # the reference cache of a sweep is kept per group of sequences
                sides["ref32"].shared = sides["ref64"].shared = shared(a, b)
            part = res if len(groups) == 1 else dataclasses.replace(res, tokens=tokens[a:b], token_info=[])
            _Loop(model, s, sides, first_seq=a, forced=None if forced is None else forced[a:b]).run(
                tokens[a:b], part, progress)
            parts.append(part)
        if len(parts) > 1:
            merge_groups(res, parts)
        if hasattr(dev, "observer_effect"):      # an engine traced from outside: does tracing change it?
            dev.observer_effect()
    check_float32_range(res)
    res.thresholds = thresholds_from_floor(res.floor, s.k_floor)
    res.first_divergence = find_first_divergence(res)
    judge = getattr(dev, "judge", None)     # an engine that knows its arithmetic paths (llama.cpp)
    if judge is not None:
        res.first_divergence, res.precision = judge(res)
        res.judged = True
    return res


def _nudged_floors(model: Model, seed: int, s: RunSettings, prompts: torch.Tensor, fed: torch.Tensor,
                   ref_cache: Optional[dict], declared: Optional[int] = None) -> dict:
    """The floors of a second opinion's sample (second_opinion.py): the references of the model nudged by `seed`
    over the run's prompts, schedule and generated tokens (`fed`), no device layers, metrics only; declared: the
    plug-in's SSD_CHUNK (`second_opinion.ssd_chunk`). A sweep keeps them beside its shared reference runs (they
    depend on nothing else)."""
    chunk = second_opinion.ssd_chunk(model.config, seed, declared)
    cache = _cache_for(ref_cache, model, prompts, s)
    kept = None if cache is None else cache.setdefault("nudged_floors", {})
    if kept is not None and (seed, chunk) in kept:
        return kept[(seed, chunk)]
    ns = s.replace(offload=0, capture="metrics", local=False, repeat=1).validated(model.config)
    ref_device = resolve_ref_device(ns.ref_device)
    on_gpu = ref_device if ref_device.type == "cuda" else None
    if on_gpu:      # the device side's weights make room for the nudged ones (made from the references' copy)
        model.release_casts(keep=on_gpu)
    placement = ns.placement(model.config.n_layer)
    try:
        nudged = second_opinion.nudged(model, seed, on_gpu)
        sides = build_sides(nudged, ns, placement, ref_device, SharedReference(None), ssd_chunk=chunk)
        try:
            res = _run_sides(nudged, ns, sides, prompts, placement, ns.seq_groups(prompts.shape[0]),
                             lambda a, b: SharedReference(None), None, forced=fed)
        finally:
            del sides
    except torch.cuda.OutOfMemoryError as exc:
        raise MambaDebugError(f"a nudged run did not fit on the GPU ({str(exc).splitlines()[0]})") from None
    if kept is not None:
        kept[(seed, chunk)] = res.floor
    return res.floor


def build_sides(model: Model, s: RunSettings, placement, ref_device: torch.device, shared: SharedReference,
                ssd_chunk: Optional[int] = None) -> dict:
    """The sides of one comparison, by role. The reference sides run plain torch ops on `ref_device`; the device
    side shares their float32 host blocks (prefix_from=ref32). ssd_chunk: the float32 reference's Mamba-2 scan in
    the chunked SSD form (a second opinion's sample)."""
    to_host = s.ref_device == "cpu"
    host = cpu_backend(ref_device, ssd_chunk)
    ref64_backend = reference_backend(ref_device)
    devs = device_backends(s.kernels, s.device, s.devices, uses=model_ops(model.config)) if s.engine == "torch" \
        else None
    dev = devs[0] if devs else None
    info = lambda name, b, device: SideInfo(name, b.label, None if name in ("ref32", "ref64") else s.kernels,  # noqa
                                            device)
    ref_is_64 = s.reference_is_float64
    sides = {
        "ref32": TorchSide(info("ref32", host, ref_device.type), model, Runner(model, host), to_host=to_host,
                           shared=shared, keep_states_before=s.local and not ref_is_64),
        "ref64": TorchSide(info("ref64", ref64_backend, ref_device.type), model, Runner(model, ref64_backend),
                           to_host=to_host, shared=shared, keep_states_before=s.local and ref_is_64),
    }
    if s.engine == "llama.cpp":
        from .sides.llamacpp import LlamaCppSide  # noqa: PLC0415 (ctypes and a library: only when asked for)
        sides["device"] = LlamaCppSide(model, s)
        return sides
    placed = lambda: Runner(model, host, devs, placement)  # noqa: E731
    sides["device"] = TorchSide(info("device", dev, s.device), model, placed(), to_host=to_host,
                                prefix_from=sides["ref32"])
    if s.repeat > 1:
        sides["repeat"] = TorchSide(info("repeat", dev, s.device), model, placed(), to_host=to_host,
                                    prefix_from=sides["ref32"], report_prefix=False)
    if s.local:
        sides["local"] = TorchSide(info("local", dev, s.device), model, placed(), to_host=to_host,
                                   local_of=sides["ref64" if ref_is_64 else "ref32"])
    return sides


class _Loop:
    """The lock-step loop over ubatches, the device's fork for its own generation, and the generations."""

    def __init__(self, model: Model, s: RunSettings, sides: dict, first_seq: int = 0,
                 forced: Optional[torch.Tensor] = None):
        self.model, self.s, self.sides, self.first_seq, self.forced = model, s, sides, first_seq, forced
        self.ref = sides["ref64" if s.reference_is_float64 else "ref32"]
        self.dev = sides["device"]
        self.shared = sides["ref32"].shared
        self.fork = None
        self.order = [(i, n) for i, lt in enumerate(sides["ref32"].runner.layer_types) for n in lt.sites]
        self.at_birth = _measures_at_birth(s, sides, self.ref)

    def run(self, tokens, res: CompareResult, progress):
        S, P = tokens.shape
        for side in self.sides.values():
            side.reset(self.s, S, first_seq=self.first_seq, n_tokens=P + self.s.n_gen)
        B = self.s.ubatch_per_seq(S)          # -ub counts tokens across the sequences (llama.cpp's equal split)
        schedule = [tokens[:, i:i + B] for i in range(0, P, B)]
        self.sides["ref32"].keep_states_after_from = len(schedule) - 1     # where generated tokens are chosen
        acc = Accumulator(res, self.s)
        fed, pos, nxt = [], 0, None
        total = len(schedule) + self.s.n_gen
        for u in range(total):
            chunk = schedule[u] if u < len(schedule) else nxt[:, None]
            T = chunk.shape[1]
            res.token_info += [TokenInfo(pos + j, u, j, T, "prompt" if u < len(schedule) else "gen") for j in range(T)]
            ref_logits, dev_logits = self._step(u, chunk, acc)
            fed.append(chunk)
            pos += T
            if self.forced is None or pos >= self.forced.shape[1]:
                nxt = ref_logits[:, -1].argmax(-1).cpu()    # the schedule's tokens stay on the CPU
            else:
                nxt = self.forced[:, pos]                   # a second opinion's run: the first run's tokens
            g = u - (len(schedule) - 1)                     # index of the generated token chosen after this ubatch
            if 0 <= g < self.s.n_gen and self.fork is None and self.s.free_run:
                self._maybe_fork(g, nxt, dev_logits[:, -1].argmax(-1).cpu())
            if progress:
                progress(u + 1, total)
        res.tokens = torch.cat(fed, dim=1)
        self.shared.complete()
        acc.finish()
        self._generations(res)

    def _step(self, u, chunk, acc: Accumulator):
        out = {}
        for name, side in self.sides.items():          # refs first: the others read them
            if name == "device" and self.at_birth:
                side.measure_against(self.ref.last.sites)
            out[name] = side.step(chunk)
        for name in ("ref32", "ref64"):                 # a NaN reference is reported, never compared against
            if not self.sides[name].from_shared:        # a shared reference's steps passed when their run made them
                check_reference(name, self.sides[name].info.label, out[name].sites, out[name].logits, u, self.order)
        extra = {}
        if "repeat" in out and self.dev.has_device:
            extra["repeat"] = out["repeat"].sites
        if "local" in out:
            extra["local"] = out["local"].sites
        v32, v64, vref = out["ref32"].sites, out["ref64"].sites, self.ref.last.sites
        derive = getattr(self.dev, "reference_sites", None)
        if derive is not None:          # what the device's op-named nodes should hold, from each reference's sites
            v32, v64 = ({**v, **derive(v, chunk)} for v in (v32, v64))
            vref = v64 if self.s.reference_is_float64 else v32
        acc.add(out["device"].sites, vref, v32, v64, extra, self.shared.floors(u))
        return self.ref.last.logits, out["device"].logits

    def _maybe_fork(self, g, ref_next, dev_next):
        """The device would pick another token than the reference here: keep its states, so its own (free-running)
        generation can continue from this point later. Until then both generations are the same tokens."""
        if torch.equal(ref_next, dev_next):
            return
        self.fork = {"g": g, "next": dev_next, "states": self.dev.save_state()}

    def _generations(self, res: CompareResult):
        """Reference text = the teacher-forced tokens; device text = the device side generating on its own, which
        costs nothing extra while it picks the reference's tokens (its states are the teacher-forced ones)."""
        model, S, G, P = self.model, res.tokens.shape[0], self.s.n_gen, res.n_prompt
        ref_gen = res.tokens[:, P:]
        dev_gen = ref_gen.clone()
        if self.fork is not None:
            self.dev.load_state(self.fork["states"])
            g, t = self.fork["g"], self.fork["next"]
            for j in range(g, G):
                dev_gen[:, j] = t
                if j + 1 < G:
                    t = self.dev.free_step(t[:, None])[:, -1].argmax(-1).cpu()
        res.generations = {
            "prompt": [model.decode(res.tokens[s, :P].tolist()) for s in range(S)],
            "reference": [model.decode(ref_gen[s].tolist()) for s in range(S)],
            "device": [model.decode(dev_gen[s].tolist()) for s in range(S)],
            "reference_ids": ref_gen.tolist(), "device_ids": dev_gen.tolist(),
            "first_difference": [_first_diff(ref_gen[s], dev_gen[s]) for s in range(S)],
        }


def _measures_at_birth(s: RunSettings, sides: dict, ref) -> bool:
    """Whether the device side measures its sites where they are born, against the reference's of the same ubatch,
    instead of handing copies to the Accumulator: with capture='metrics' (nothing but metrics is kept), no repeat
    run (it compares the device's values), a torch device side, and the reference on a GPU. On the CPU the
    Accumulator's stacked torch passes over a whole ubatch are fewer than over each layer's sites (metrics.py)."""
    return (s.capture == "metrics" and "repeat" not in sides and hasattr(sides["device"], "measure_against")
            and (ref.info.device != "cpu" or AT_BIRTH_ON_CPU))


AT_BIRTH_ON_CPU = False     # tests: the at-birth path on a machine without a GPU (same values, slower)


def _first_diff(a, b):
    idx = torch.nonzero(a != b)
    return int(idx[0]) if idx.numel() else None


def _cache_for(ref_cache, model, tokens, s: RunSettings):
    """The part of a shared reference cache for this prompt, ubatch, n_gen and local mode."""
    if ref_cache is None:
        return None
    key = (id(model), tuple(map(tuple, tokens.tolist())), s.ubatch, s.n_gen, s.local, s.reference, s.ref_device)
    return ref_cache.setdefault(key, {})
