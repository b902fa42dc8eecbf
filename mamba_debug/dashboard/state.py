"""The dashboard's state: what is on screen (`DashState`) and the runs it has seen (`RunCache`).

A run is a prompt and a `RunSettings` (frozen, hashable: the settings object is the cache key); a view state is
what is looked at inside that run (`views.base.ViewState`). The dashboard diffs the state it reads from its widgets
with the one on screen: a new run key runs (or fetches) a comparison, a new view state redraws what depends on it.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..compare import run_compare
from ..errors import MambaDebugError
from ..model import prompt_list
from ..settings import ENGINES, RunSettings, whole_ubatch
from ..settings_checks import check_count
from ..sweep import same_run_offloads
from ..trace import find_first_divergence
from ..views.base import ViewState

# What every dashboard run captures. A result computed elsewhere with more (local errors, repeats, another capture
# policy) still serves its configuration: `dashboard_settings` maps its settings onto the dashboard's key.
DASHBOARD_RUN = dict(capture="all", capture_layers=None, capture_sites=None, local=False, repeat=1)
Prompt = Union[str, Sequence[int], Sequence[str]]


def encode_prompts(model, prompt: Prompt) -> tuple:
    """(labels, token ids per prompt) of text, token ids, or a list of texts (a prompt dropdown)."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif len(prompt) and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    else:
        ids = prompt_list(prompt)
        if not ids:
            raise MambaDebugError("prompt is empty: give text, token ids or a list of texts")
        return [model.decode(ids)[:60]], [ids]
    ids = [model.encode(t) for t in texts]
    for t, i in zip(texts, ids):
        if not i:
            raise MambaDebugError(f"prompt {t!r} encodes to no tokens; give text with at least one token")
    return texts, ids


def check_args(offload, ubatch, n_seqs, dpi, max_cached_runs, engine="torch") -> None:
    """The dashboard's arguments, refused naming the argument: its sliders would clamp them instead (offload=-1
    showed offload 0, ubatch=0 the whole prompt; n_seqs=0 and engine="x" were ipywidgets TraitErrors)."""
    if engine not in ENGINES:
        raise MambaDebugError(f"engine={engine!r}: choose one of {list(ENGINES)}")
    for name, v, low in (("offload", offload, 0), ("ubatch", ubatch, 1)):
        if v is not None:
            check_count(name, v, low)
    check_count("n_seqs", n_seqs, 1)
    check_count("dpi", dpi, 1)
    check_count("max_cached_runs", max_cached_runs, 0)


def check_value(name: str, widget, value) -> None:
    """A value `Dashboard.set` gives a control: inside a slider's range (it would clamp silently; past the top is
    kept for offload and ubatch, where it means what -ngl 99 and a -ub past the prompt mean: all of it), one of a
    dropdown's options (kernels excepted: a new plug-in is added), naming the control and what it takes."""
    if hasattr(widget, "max") and hasattr(widget, "min"):
        check_count(name, value, widget.min)
        if value > widget.max and name not in ("offload", "ubatch"):
            raise MambaDebugError(f"{name}={value}: the control goes from {widget.min} to {widget.max}")
    elif name != "kernels" and hasattr(widget, "options"):
        values = [o[1] if isinstance(o, tuple) else o for o in widget.options]
        if value not in values:
            raise MambaDebugError(f"{name}={value!r}: choose one of {values}")


@dataclass(frozen=True)
class DashState:
    prompt: int               # index into the dashboard's prompts
    run: RunSettings          # what the comparison runs with (with the prompt: the cache key)
    view: ViewState           # what is looked at in it

    def label(self) -> str:
        s = self.run
        return f"offload {s.offload}, ubatch {s.ubatch}, {device_name(s)}"


def device_name(settings: RunSettings) -> str:
    """What the device side is, in the dashboard's words: the kernels (engine torch) or llama.cpp."""
    return "llama.cpp" if settings.engine == "llama.cpp" else f"kernels {settings.kernels}"


def engine_settings(base: RunSettings, engine: str, kernels: str, llama_device: str = "cpu") -> RunSettings:
    """The run settings of one engine choice. llama.cpp runs no torch kernels: its key keeps the default kernels (so
    a kernels choice made before switching does not split its cache) and its own device (cpu: -ngl 0)."""
    if engine == "llama.cpp":
        return base.replace(engine=engine, kernels=RunSettings.kernels, device=llama_device)
    return base.replace(engine=engine, kernels=kernels)


def llama_cpp_problem(llama_lib: Optional[str], device: str) -> Optional[str]:
    """Why no llama.cpp library can serve the dashboard (None: one loads and passes its checks)."""
    from ..errors import MambaDebugError  # noqa: PLC0415
    from ..sides.llamacpp.lib import load_library  # noqa: PLC0415 (ctypes and a library: only when asked for)
    try:
        load_library(llama_lib, device)
    except (MambaDebugError, OSError) as exc:
        return str(exc)
    return None


def dashboard_settings(settings: RunSettings, n_prompt: int) -> RunSettings:
    """The dashboard's key for a run with these settings: every ubatch >= the prompt's tokens of all sequences is
    one schedule (one ubatch; -ub counts tokens across the sequences), and the capture knobs are the dashboard's
    own."""
    return settings.replace(ubatch=min(settings.ubatch, whole_ubatch(n_prompt, settings.n_seqs)), **DASHBOARD_RUN)


def moved_head(res, offload: int, n_layer: int):
    """The result of `res`'s run at another offload that computes the same bits (only the head's placement
    differs): the same numbers, this offload's settings and placement, its first divergence's `on_device`."""
    s = res.settings.replace(offload=offload)
    out = dataclasses.replace(res, settings=s, placement=s.placement(n_layer),
                              timings=dict(res.timings, same_run_as=res.placement.offload))
    out.first_divergence = find_first_divergence(out)
    return out


class RunCache:
    """One CompareResult per (prompt ids, RunSettings), least recently used dropped past `max_runs`; plus the
    reference side shared by runs that differ only in offload/kernels (run_compare's ref_cache)."""

    def __init__(self, max_runs: int = 32):
        self.max_runs = max_runs
        self.runs: OrderedDict = OrderedDict()
        self.ref: dict = {}
        self.state = None           # the model's weights the runs were made with (Model.params_state)

    def follow(self, model) -> bool:
        """Forget every run (and the shared reference) when the model's weights changed since they were made (an edit
        between two updates was answered from the cache); True when it did."""
        state, changed = model.params_state(), False
        if self.state is not None and state != self.state and (self.runs or self.ref):
            self.runs.clear()
            self.ref.clear()
            changed = True
        self.state = state
        return changed

    @staticmethod
    def key(prompt_ids, settings: RunSettings) -> tuple:
        return tuple(int(t) for t in prompt_ids), settings

    def get(self, prompt_ids, settings: RunSettings):
        key = self.key(prompt_ids, settings)
        res = self.runs.get(key)
        if res is not None:
            self.runs.move_to_end(key)
        return res

    def put(self, prompt_ids, settings: RunSettings, res):
        key = self.key(prompt_ids, settings)
        self.runs[key] = res
        self.runs.move_to_end(key)
        while len(self.runs) > self.max_runs:
            self.runs.popitem(last=False)

    def compute(self, model, prompt_ids, settings: RunSettings, progress=None):
        """The run of these settings: from a cached run that computed the same bits (the head moved: see
        `sweep.same_run_offloads`; `timings["same_run_as"]` names its offload), else run_compare."""
        res = self._same_run(model, prompt_ids, settings)
        if res is None:
            res = run_compare(model, list(prompt_ids), settings, progress=progress, ref_cache=self.ref)
        self.put(prompt_ids, settings, res)
        return res

    def _same_run(self, model, prompt_ids, settings: RunSettings):
        for offload in same_run_offloads(model, settings):
            twin = self.get(prompt_ids, settings.replace(offload=offload))
            if twin is not None and not twin.judged:
                return moved_head(twin, settings.offload, model.config.n_layer)
        return None

    def has(self, prompt_ids, settings: Optional[RunSettings]) -> bool:
        return self.key(prompt_ids, settings) in self.runs

    def __contains__(self, key) -> bool:
        """`(prompt_ids, settings) in cache`."""
        return self.key(*key) in self.runs

    def __len__(self) -> int:
        return len(self.runs)
