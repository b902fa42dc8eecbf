"""Sweeps over offload x ubatch (x sequences) and bisection of the offload boundary.

A sweep shares the reference side between all offload counts of one ubatch size (it does not depend on
placement), and each device run starts at its boundary from the shared host blocks, so the whole
0..n_layer+1 grid costs about half of what independent runs would. Where the device side runs on the CPU
(interpret, cpu) and the plug-in leaves the head's ops (rms_norm, linear) to plain torch, moving the head
changes no bit: two offloads with the same device blocks are then one run, and the cell says so
(`same_run_as`).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from .budget import workers_that_fit
from .compare import run_compare
from .errors import MambaDebugError
from .model import Model, prompt_list, require_model
from .plugins import load_plugin
from .settings import RunSettings, as_settings, resolve_device
from .settings_checks import check_count, plain
from .trace import json_num


def sweep_cell(res) -> dict:
    """One cell of a sweep matrix from a finished comparison (JSON-safe: inf/nan written as strings)."""
    fd = res.first_divergence
    kld = res.logits["kld"]
    return {"offload": res.placement.offload, "ubatch": res.settings.ubatch, "n_seqs": res.settings.n_seqs,
            "first_divergence": fd, "first_token": None if fd is None else fd["token"],
            "first_layer": None if fd is None else fd["layer"], "kld_mean": json_num(kld.mean()),
            "kld_max": json_num(kld.max()), "top1_agreement": json_num(res.logits["top1"].mean()),
            "seconds": res.timings.get("compare_s"), **_second_opinion(res)}


def _second_opinion(res) -> dict:
    """A cell's second opinion in one word, where one was wanted: confirmed, rounding (the cell reads clean) or not
    taken."""
    so = res.second_opinion
    if not so:
        return {}
    return {"second_opinion": "not taken" if not so["taken"] else "confirmed" if so["confirmed"] else "rounding"}


def _axis(name: str, values) -> list:
    """One axis of the grid as a list, each value once in the order given (a repeated value ran its cells twice
    and drew them twice); a string (its characters were read as the values) or an empty axis refused."""
    if isinstance(values, (str, bytes)):
        raise MambaDebugError(f"{name} must be a list of integers (e.g. [1, 8, 32] or range(0, 14)), not a string")
    out = list(dict.fromkeys(plain("offload", v) for v in values))
    if not out:
        raise MambaDebugError(f"{name} is empty: give at least one value")
    return out


def run_sweep(model: Model, prompt_ids, base: RunSettings, offloads: Optional[Iterable[int]] = None,
              ubatches: Iterable[int] = (1, 2, 8, 32), n_seqs_list: Iterable[int] = (1,), progress=True,
              workers: int = 1, ray: Optional[str] = None) -> dict:
    """Matrix of first divergence (token, layer) and KLD for every (n_seqs, ubatch, offload).

    workers > 1 runs cells in that many processes (each reloads the model from its path and keeps its own
    reference cache): worth it where the device side is the single-threaded Triton interpreter.
    ray: each cell a Ray task, on the cluster at that address ("auto": the running one) or, "local", on a Ray
    started here (one CPU, or the GPUs of the split, per task); an already initialised Ray is used as it is."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    require_model(model, "run_sweep")
    base = as_settings(base, "run_sweep", "base")
    prompt_ids = prompt_list(prompt_ids)            # an iterator is read once, here
    L = model.config.n_layer
    check_count("workers", workers, 1)
    offloads = _axis("offloads", range(0, L + 2) if offloads is None else offloads)
    ubatches, n_seqs_list = _axis("ubatches", ubatches), _axis("n_seqs_list", n_seqs_list)
    grid = [(s, u, o) for s in n_seqs_list for u in ubatches for o in offloads]
    runs = _runs_for(model, base, offloads)
    jobs = [base.replace(offload=o, ubatch=u, n_seqs=s, capture="metrics", free_run=False)
            for s, u, o in grid if runs[o] == o]
    for job in jobs:                        # every cell's settings checked before the first one runs
        job.validated(model.config)
    workers = max(1, min(workers, len(jobs)))       # a worker loads its own model: none without a run to do
    if workers > 1:     # longest first, so that no worker is left with one long run at the end
        jobs.sort(key=lambda j: -_cost(j, L, len(prompt_ids)))
    t0 = time.perf_counter()
    bar = tqdm(total=len(jobs), desc="sweep", disable=not progress, unit="run")
    if (workers > 1 or ray is not None) and not _reloadable(model):
        raise MambaDebugError("a parallel sweep reloads the model in each worker, so it needs a model loaded from a "
                              "path (md.load_model); use workers=1 for a model built in memory")
    cells: list = []
    try:
        if ray is not None:
            _on_ray(ray, model.source, list(prompt_ids), jobs, bar, cells)
        elif workers > 1:
            _parallel(model.source, list(prompt_ids), jobs, workers, bar, cells)
        else:
            cache: dict = {}
            for settings in jobs:
                bar.set_postfix_str(f"S={settings.n_seqs} ub={settings.ubatch} ngl={settings.offload}")
                cells.append(sweep_cell(run_compare(model, prompt_ids, settings, ref_cache=cache)))
                bar.update()
    except KeyboardInterrupt:               # stop now: the cell being run is dropped, the finished ones kept
        bar.close()
        part = _grid_cells(grid, runs, cells, L, base, partial=True) | {
            "offloads": offloads, "ubatches": ubatches, "n_seqs": n_seqs_list, "kernels": base.kernels,
            "incomplete": True, "seconds": time.perf_counter() - t0, "workers": workers,
            **({"ray": ray} if ray is not None else {})}
        raise Interrupted(part, f"{part['cells_done']} of {part['cells_total']} cells finished") from None
    except BaseException:
        bar.close()                         # the error's line starts on a line of its own
        raise
    bar.close()
    return {"offloads": offloads, "ubatches": ubatches, "n_seqs": n_seqs_list, "kernels": base.kernels,
            "cells": _grid_cells(grid, runs, cells, L, base)["cells"], "seconds": time.perf_counter() - t0,
            "workers": workers, **({"ray": ray} if ray is not None else {})}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM during a sweep or a bisection; `partial` holds the finished work (`"incomplete": true`,
    what was done and what was not run)."""

    def __init__(self, partial: dict, done: str):
        super().__init__("interrupted")
        self.partial, self.done = partial, done


SweepInterrupted = Interrupted      # the name before bisect kept its runs too


def _grid_cells(grid, runs, cells, L, base, partial=False) -> dict:
    done = {(c["n_seqs"], c["ubatch"], c["offload"]): c for c in cells}
    out = [done[(s, u, o)] if runs[o] == o else _same_as(done[(s, u, runs[o])], o, L, base)
           for s, u, o in grid if not partial or (s, u, runs[o]) in done]
    if not partial:
        return {"cells": out}
    not_run = [{"n_seqs": s, "ubatch": u, "offload": o} for s, u, o in grid if (s, u, runs[o]) not in done]
    return {"cells": out, "cells_done": len(out), "cells_total": len(grid), "not_run": not_run}


def _cost(s: RunSettings, n_layer: int, n_prompt: int) -> int:
    """Relative cost of a sweep run: device blocks x kernel launches (what dominates under the interpreter)."""
    return (s.placement(n_layer).n_device_layers + 1) * (-(-n_prompt // s.ubatch) + s.n_gen)


def _runs_for(model: Model, base: RunSettings, offloads: list) -> dict:
    """offload -> the offload whose run answers for it: itself, or, when the head's placement changes no bit (see
    the module docstring), the offload with the same device blocks and the head on the device."""
    device = resolve_device(base.device)
    head_ops = set() if base.kernels in (None, "torch") else {"rms_norm", "linear"} & set(
        load_plugin(base.kernels, device).ops)
    if device == "cuda" or head_ops:
        return {o: o for o in offloads}
    L, by_blocks = model.config.n_layer, {}
    place = lambda o: base.replace(offload=o).placement(L)  # noqa: E731
    # the same blocks on the same device slots (with --devices the split moves with the offload, so the count alone
    # is not enough), and no device boundary at the head (a plug-in's transfer there would change bits)
    crosses = lambda o: L in place(o).device_boundaries  # noqa: E731
    for o in sorted(offloads, key=lambda o: (not place(o).head_on_device, o)):
        if not crosses(o):
            by_blocks.setdefault(place(o).layer_slots, o)
    return {o: o if crosses(o) else by_blocks[place(o).layer_slots] for o in offloads}


def same_run_offloads(model: Model, settings: RunSettings) -> list:
    """The other offloads whose run computes the same bits as this one's (they differ only in where the head runs,
    and that changes no bit: see the module docstring); [] when there are none or the engine is not torch."""
    if settings.engine != "torch":
        return []
    L = model.config.n_layer
    offload = L + 1 if settings.offload is None else settings.offload
    runs = _runs_for(model, settings, list(range(L + 2)))
    return [o for o in range(L + 2) if o != offload and runs[o] == runs.get(offload)]


def _same_as(cell: dict, offload: int, n_layer: int, base: RunSettings) -> dict:
    """The cell of `offload` from the run of another offload that computes the same bits."""
    out = dict(cell, offload=offload, same_run_as=cell["offload"])
    fd = cell["first_divergence"]
    if fd is not None and fd["layer"] is None:          # a head site: on the device or not, per this offload
        out["first_divergence"] = dict(fd, on_device=base.replace(offload=offload).placement(n_layer).head_on_device)
    return out


def auto_workers(model: Model, device: Optional[str], largest: Optional[RunSettings] = None,
                 n_tok: int = 0) -> int:
    """Processes for a sweep: the cores (at most 4), when the device side is interpreted on the CPU and the model
    reloadable; no more than the host memory holds with each worker's own copy of the model running `largest`
    (the grid's largest cell), said on stderr when that is fewer."""
    if resolve_device(device) == "cuda" or not _reloadable(model):
        return 1
    cores = max(1, min(os.cpu_count() or 1, 4))
    if largest is None:
        return cores
    fit = workers_that_fit(model.config, largest.validated(model.config), n_tok)
    if fit < cores:
        print(f"sweep: {fit} worker process(es), not {cores}: each loads its own copy of the model and runs its cells, "
              f"and the host memory holds {fit} (--workers N sets the count)", file=sys.stderr)
    return min(cores, fit)


def _reloadable(model: Model) -> bool:
    return bool(model.source) and Path(model.source).exists()


_WORKER: dict = {}


def _worker_cell(source: str, prompt_ids: list, settings: RunSettings) -> dict:
    """One sweep cell in a worker process; the model and the reference cache stay loaded between cells."""
    if _WORKER.get("source") != source:
        from .io import load_model  # noqa: PLC0415
        _WORKER.update(source=source, model=load_model(source), cache={})
    return sweep_cell(run_compare(_WORKER["model"], prompt_ids, settings, ref_cache=_WORKER["cache"]))


def _worker_init():
    """Workers leave Ctrl-C to the parent, which keeps their finished cells and stops them."""
    import signal  # noqa: PLC0415
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _parallel(source, prompt_ids, jobs, workers, bar, cells: list) -> list:
    import multiprocessing  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    # spawn, not fork: torch and Triton hold threads and state that a fork would copy half-initialised;
    # one thread per worker, since the workers already take every core
    ctx = multiprocessing.get_context("spawn")
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init)
    futures: list = []
    try:
        futures = [pool.submit(_worker_cell, source, prompt_ids, s) for s in jobs]
        for f in futures:          # in grid order; the bar moves as they finish
            cells.append(f.result())
            bar.update()
        pool.shutdown()
    except BaseException:
        # Ctrl-C, SIGTERM or a failed cell: keep the cells that finished, stop the workers now (a plain shutdown
        # would wait for every running cell)
        cells.extend(f.result() for f in futures[len(cells):] if f.done() and not f.cancelled()
                     and f.exception() is None)
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=5)
        raise
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    return cells


def _on_ray(address: str, source, prompt_ids, jobs, bar, cells: list) -> list:
    """Each cell a Ray task (`_worker_cell`: the worker reloads the model from its path, which every machine must
    reach, and keeps it and its reference cache between tasks). Results in grid order, as the serial sweep's."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise MambaDebugError("--ray needs Ray: pip install ray (on every machine of the cluster)") from None
    started = not ray.is_initialized()
    if started:
        _check_reachable(address)
        try:
            ray.init(address=None if address == "local" else address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise MambaDebugError(f"--ray {address}: cannot connect ({exc}); start a cluster there (ray start "
                                  f"--head), or use --ray local") from None
    refs: list = []
    try:
        for s in jobs:
            gpus = (len(s.devices) if s.devices else 1) if resolve_device(s.device) == "cuda" else 0
            task = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=0)(_worker_cell)
            refs.append(task.remote(source, prompt_ids, s))
        for r in refs:
            cells.append(ray.get(r))
            bar.update()
    except BaseException:
        for r in refs[len(cells):]:
            ray.cancel(r, force=True)
        raise
    finally:
        if started:
            ray.shutdown()
    return cells


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT (or ray://HOST:PORT) address answers a TCP connection within seconds: Ray itself retries an
    unreachable one for minutes without a word."""
    host, sep, port = address.split("://")[-1].rpartition(":")
    if not sep or not port.isdigit():
        return                                  # "local", "auto": Ray answers those at once
    import socket  # noqa: PLC0415
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise MambaDebugError(f"--ray {address}: nothing answers there ({exc.strerror or exc}); start a cluster "
                              f"there (ray start --head), or use --ray local") from None


def bisect_layer(model: Model, prompt_ids, base: RunSettings) -> dict:
    """Smallest offload that diverges, found in O(log n_layer) runs; its first device layer is the first bad one.

    Assumes monotonicity, as llama.cpp's placement gives it: offload N+1 runs a superset of N's device layers.
    """
    require_model(model, "bisect_layer")
    base = as_settings(base, "bisect_layer", "base")
    L, prompt_ids = model.config.n_layer, prompt_list(prompt_ids)       # an iterator is read once, here
    cache: dict = {}
    runs = []

    def diverges(n: int) -> bool:
        settings = base.replace(offload=n, capture="metrics", free_run=False)
        res = run_compare(model, prompt_ids, settings, ref_cache=cache)
        runs.append({"offload": n, "first_divergence": res.first_divergence})
        return res.first_divergence is not None

    lo, hi = 0, L + 1             # offload 0 runs nothing on the device: clean by construction; L + 1 everything
    llama = base.engine == "llama.cpp"
    if llama and (base.device or "cpu") == "cpu":
        raise MambaDebugError("bisect moves the offload boundary (-ngl), and --engine llama.cpp --device cpu runs "
                              "every layer on the CPU whatever the offload: bisect a CUDA build (--device cuda), or "
                              "run compare")
    try:
        if llama and diverges(0):     # llama.cpp's own CPU backend runs offload 0, not the reference
            return {"bad_layer": None, "offload": 0, "runs": runs,
                    "message": "offload 0 already diverges (every layer on llama.cpp's CPU backend): the offload "
                               "boundary separates no bad layer; `compare --offload 0` shows where it begins"}
        if not diverges(hi):
            return {"bad_layer": None, "offload": None, "runs": runs,
                    "message": f"no divergence even with everything offloaded (offload {hi})"}
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if diverges(mid):
                hi = mid
            else:
                lo = mid
    except KeyboardInterrupt:     # stop now: the run in progress is dropped, the finished ones kept
        raise Interrupted(_bisect_partial(runs, lo, hi), f"{len(runs)} run(s) finished") from None
    p = base.replace(offload=hi).placement(L)
    newest = p.first_device_layer if p.n_device_layers > base.replace(offload=hi - 1).placement(L).n_device_layers else None
    bad = "head" if newest is None else newest    # what offload hi adds over hi - 1: a block, or the head
    return {"bad_layer": bad, "offload": hi, "runs": runs,
            "message": f"offload {hi - 1} is clean, offload {hi} diverges: the first bad "
                       f"{'part is the output head' if bad == 'head' else 'layer is %d' % bad} "
                       f"({len(runs)} runs for {L} layers)"}


def _bisect_partial(runs: list, lo: int, hi: int) -> dict:
    """What an interrupted bisection knows: offload `lo` is clean, `hi` diverges once a run has shown it, and the
    offloads between them (`not_run`) are undecided."""
    known = any(r["offload"] == hi and r["first_divergence"] is not None for r in runs)
    undecided = list(range(lo + 1, hi)) if known else list(range(lo + 1, hi + 1))
    message = (f"interrupted: offload {lo} is clean, offload {hi} diverges; the first diverging offload is one of "
               f"{lo + 1}..{hi}" if known else "interrupted before the run with everything offloaded finished")
    return {"incomplete": True, "bad_layer": None, "offload": None, "runs": runs, "runs_done": len(runs),
            "clean_offload": lo, "diverging_offload": hi if known else None, "not_run": undecided,
            "message": message}
