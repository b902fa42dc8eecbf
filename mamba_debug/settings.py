"""One `RunSettings`: every knob of a comparison, each default written once, one validation, one `Placement`.

The command line builds its flags from the fields' metadata (`cli.add_settings_flags`); the dashboard and notebooks
build `RunSettings` directly; a sweep cell is `replace(base, offload=o, ubatch=u)`. Frozen and hashable, so the
dashboard's cache key is simply (prompt, settings).

`ubatch` is llama.cpp's -ub: tokens across all sequences; a ubatch holds `ubatch // n_seqs` tokens of each sequence
(llama.cpp's equal split; `ubatch_per_seq`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from .arch import all_sites
from .config import ModelConfig
from .errors import MambaDebugError
from .placement import RULES, Placement
from .settings_checks import check_layers, check_numbers, plain

DEFAULT_UBATCH = 512
DEVICES = ("cuda", "interpret", "cpu")
REF_DEVICES = ("cpu", "cuda")
REFERENCES = ("float32", "float64")
CAPTURE_POLICIES = ("all", "sites", "metrics")
ENGINES = ("torch", "llama.cpp")
LLAMA_MAX_SEQ = 256          # llama.cpp's most sequences in one context (src/llama-cparams.h)
# A site diverges when rel_l2(dev, ref) > K_FLOOR * max(floor, MIN_FLOOR) (trace.py): two float32 implementations
# that differ only in the order of operations sit near 1-2x the floor; real bugs 100x-1e8x.
K_FLOOR = 10.0


def _flag(help: str, *, commands: str = "run", **kw) -> dict:
    """Field metadata for the command line: the flag's help, which commands take it ("run": compare, sweep, bisect,
    export-case; "compare": compare only; "point": every run command but sweep/bisect, which choose it themselves;
    "schedule": every run command but sweep, whose --ubatches / --n-seqs-list choose it), and argparse extras (type
    parser name, choices, flag name)."""
    return {"help": help, "commands": commands, **kw}


def whole_ubatch(n_prompt: int, n_seqs: int) -> int:
    """The smallest -ub that holds the whole prompt of every sequence in one ubatch (-ub counts tokens across the
    sequences): every larger one runs the same schedule."""
    return n_prompt * n_seqs


@dataclass(frozen=True)
class RunSettings:
    offload: Optional[int] = field(default=None, metadata=_flag(
        "like -ngl: the last N blocks run on the device (default: all, head included)", commands="point",
        parse="nonneg"))
    ubatch: int = field(default=DEFAULT_UBATCH, metadata=_flag(f"like -ub (default {DEFAULT_UBATCH})", parse="positive",
                                                               commands="schedule"))
    n_seqs: int = field(default=1, metadata=_flag("sequences processed together", parse="positive",
                                                  commands="schedule"))
    n_gen: int = field(default=16, metadata=_flag("tokens generated after the prompt", parse="n_gen"))
    kernels: str = field(default="triton", metadata=_flag(
        "plug-in name in kernels/ or a .py path (torch: plain ops)"))
    device: Optional[str] = field(default=None, metadata=_flag(
        "where the device side runs (auto: cuda if a GPU exists, else the Triton interpreter)",
        choices=("auto",) + DEVICES, cli_default="auto"))
    reference: str = field(default="float32", metadata=_flag("reference side precision", choices=REFERENCES))
    ref_device: str = field(default="cpu", metadata=_flag(
        "where the reference sides run their plain torch ops (cuda: for big models; default cpu)", choices=REF_DEVICES))
    rule: str = field(default="llama2024", metadata=_flag("-ngl placement rule", choices=RULES))
    k_floor: float = field(default=K_FLOOR, metadata=_flag("flag errors beyond k x the rounding floor", parse="float"))
    capture: str = field(default="all", metadata=_flag(
        "what to keep of the sites: all, sites (--layers/--sites), metrics (no tensors)", commands="compare",
        choices=CAPTURE_POLICIES))
    capture_layers: Optional[tuple] = field(default=None, metadata=_flag(
        "capture only these layers (e.g. 0,3 or 2..5)", commands="compare", flag="--layers", parse="int_list"))
    capture_sites: Optional[tuple] = field(default=None, metadata=_flag(
        "capture only these sites (comma-separated names)", commands="compare", flag="--sites", parse="str_list"))
    memory_budget_mb: float = field(default=2048.0, metadata=_flag(
        "refuse to keep more captured tensors than this", commands="compare", parse="float"))
    local: bool = field(default=False, metadata=_flag(
        "also measure each device layer's own (local) error", commands="compare", parse="store_true"))
    repeat: int = field(default=1, metadata=_flag(
        ">= 2: run the device twice, report nondeterminism", commands="compare", parse="int"))
    engine: str = field(default="torch", metadata=_flag(
        "the device side: torch (the Triton kernels / a plug-in) or llama.cpp (a llama.cpp build, traced)",
        choices=ENGINES))
    llama_lib: Optional[str] = field(default=None, metadata=_flag(
        "--engine llama.cpp: folder holding libllama.so and its ggml libraries (default: LLAMA_CPP_LIB_PATH, else "
        "llama-cpp-python's)"))
    op_offload: bool = field(default=True, metadata=_flag(
        "--engine llama.cpp: switch off op offload (big-batch ops of CPU layers sent to the GPU)", flag="--no-op-offload",
        parse="store_false"))
    fp32_everywhere: bool = field(default=False, metadata=_flag(
        "--engine llama.cpp: set every switch that keeps float32 paths in FP32 (NVIDIA_TF32_OVERRIDE=0, ...)",
        parse="store_true"))
    devices: Optional[tuple] = field(default=None, metadata=_flag(
        "several devices in order, e.g. cuda:0,cuda:1 (llama.cpp's --split-mode layer): the offloaded blocks are "
        "split over them, the head on the last; cpu,cpu are CPU stand-ins (--device interpret or cpu)",
        parse="str_list"))
    tensor_split: Optional[tuple] = field(default=None, metadata=_flag(
        "like --tensor-split: each device's share of the offloaded blocks, e.g. 3,1 (default: equal shares)",
        parse="float_list"))
    free_run: bool = True                # also let the device side generate on its own (text view); no flag

    def __post_init__(self):
        for f in dataclasses.fields(self):      # lists become tuples (the settings must stay hashable), numpy's
            object.__setattr__(self, f.name, plain(f.name, getattr(self, f.name)))     # scalars Python's
        if self.device == "auto":
            object.__setattr__(self, "device", None)

    def replace(self, **changes) -> "RunSettings":
        return dataclasses.replace(self, **changes)

    def validated(self, cfg: ModelConfig) -> "RunSettings":
        """The one check of every field against the model; returns the settings with offload and device resolved
        (offload None -> every block and the head, like -ngl 99; device None -> cuda or interpret)."""
        check_numbers(self)                 # finite, typed, in range: before any comparison with them
        resolve_ref_device(self.ref_device)
        if self.reference not in REFERENCES + ("fp64",):
            raise MambaDebugError(f"unknown reference precision {self.reference!r}: use float32 or float64")
        if self.capture not in CAPTURE_POLICIES:
            raise MambaDebugError(f"capture policy {self.capture!r} unknown: choose one of {CAPTURE_POLICIES}")
        sites = all_sites(cfg)
        for s in self.capture_sites or ():
            if s not in sites:
                raise MambaDebugError(f"unknown site name {s!r}; the sites are {', '.join(sites)}")
        check_layers(self.capture_layers, cfg.n_layer)
        if self.engine not in ENGINES:
            raise MambaDebugError(f"unknown engine {self.engine!r}: choose one of {ENGINES}")
        if self.engine == "llama.cpp" and self.repeat > 1:
            raise MambaDebugError("--repeat runs the torch device side again; with --engine llama.cpp it is not "
                                  "available yet (the side reports its observer effect instead)")
        self._check_engine_flags()
        if self.repeat < 1:
            raise MambaDebugError(f"repeat must be >= 1, got {self.repeat}")
        if self.k_floor <= 1:
            raise MambaDebugError(f"k_floor must be > 1 (a multiple of the rounding floor), got {self.k_floor}")
        offload = cfg.n_layer + 1 if self.offload is None else self.offload   # beyond the blocks: all (-ngl 99)
        device = (self.device or "cpu") if self.engine == "llama.cpp" else resolve_device(self.device)
        devices = resolve_devices(self.devices, device, self.engine)
        out = dataclasses.replace(self, offload=offload, device=device, devices=devices)
        out.placement(cfg.n_layer)          # checks offload, rule and the split
        return out

    def _check_engine_flags(self):
        """Flags of the other engine, refused rather than ignored (a llama.cpp run's JSON once said kernels
        'bug_a_negated', which never ran)."""
        if self.engine == "llama.cpp":
            if self.kernels != RunSettings.kernels:
                raise MambaDebugError(f"--kernels {self.kernels}: picks the torch engine's device kernels; "
                                      f"--engine llama.cpp runs llama.cpp's own: drop --kernels")
            if self.n_seqs > LLAMA_MAX_SEQ:
                raise MambaDebugError(f"--n-seqs {self.n_seqs}: llama.cpp holds at most {LLAMA_MAX_SEQ} sequences in "
                                      f"a context (LLAMA_MAX_SEQ); use --n-seqs {LLAMA_MAX_SEQ} or fewer")
            return
        for flag, given in (("--no-op-offload", not self.op_offload), ("--fp32-everywhere", self.fp32_everywhere)):
            if given:
                raise MambaDebugError(f"{flag}: a switch of llama.cpp's; add --engine llama.cpp or drop it")

    def placement(self, n_layer: int) -> Placement:
        """The one place a Placement is made (offload None: every block and the head)."""
        return Placement(n_layer, n_layer + 1 if self.offload is None else self.offload, self.rule,
                         self.devices or (), self.tensor_split or ())

    def ubatch_per_seq(self, n_seqs: Optional[int] = None) -> int:
        """Tokens of each sequence in one ubatch: llama.cpp's equal split of -ub over the sequences."""
        return max(1, self.ubatch // min(n_seqs or self.n_seqs, self.ubatch + 1))

    def seqs_per_ubatch(self, n_seqs: Optional[int] = None) -> int:
        """Sequences in one ubatch. llama.cpp's `split_equal` takes sequences until it holds one more than -ub
        (`cur_seq_set.size() > n_ubatch`), so -ub B puts min(S, B + 1) sequences, one token each when B < S."""
        return min(n_seqs or self.n_seqs, self.ubatch + 1)

    def seq_groups(self, n_seqs: Optional[int] = None) -> list:
        """The sequences that share ubatches, as (first, stop) ranges. One range unless -ub + 1 < S: then
        llama.cpp's equal split runs groups of -ub + 1 sequences, each group's tokens before the next group's (the
        order it takes them from one batch holding every sequence's prompt)."""
        S = n_seqs or self.n_seqs
        G = self.seqs_per_ubatch(S)
        return [(a, min(a + G, S)) for a in range(0, S, G)]

    @property
    def reference_is_float64(self) -> bool:
        return self.reference in ("float64", "fp64")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in LIST_FIELDS:
            if d[name] is not None:
                d[name] = list(d[name])
        return d


def as_settings(settings, fn: str, name: str = "settings") -> "RunSettings":
    """A public function's settings: a RunSettings, a dict of its fields, or None (the defaults); anything else, or
    a dict with a field that does not exist, refused naming the function."""
    if settings is None:
        return RunSettings()
    if isinstance(settings, dict):
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(RunSettings)})
        if unknown:
            raise MambaDebugError(f"{fn}: {name} has no field(s) {', '.join(map(str, unknown))}; "
                                  f"md.RunSettings' fields are its arguments (help(md.RunSettings))")
        return RunSettings(**settings)
    if not isinstance(settings, RunSettings):
        raise MambaDebugError(f"{fn}: {name} must be a md.RunSettings (or a dict of its fields), got a "
                              f"{type(settings).__name__}")
    return settings


LIST_FIELDS = ("capture_layers", "capture_sites", "devices", "tensor_split")

# The name callers used before the restructure.
CompareSettings = RunSettings


def resolve_device(device: Optional[str]) -> str:
    """'auto'/None picks cuda when a GPU exists, else the Triton interpreter. Never a silent fallback."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "interpret"
    if device not in DEVICES:
        raise MambaDebugError(f"unknown device {device!r}: choose one of {DEVICES}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MambaDebugError("device 'cuda' was asked for but torch sees no GPU; use --device interpret to run "
                              "the same Triton kernels under Triton's interpreter on the CPU")
    return device


def resolve_devices(devices: Optional[tuple], device: str, engine: str = "torch") -> Optional[tuple]:
    """--devices against the device side: cuda:N entries (N below torch's GPU count) for --device cuda, CPU
    stand-ins (`cpu`) for interpret and cpu, whose kernels take CPU tensors. `cuda` alone is cuda:0."""
    if devices is None:
        return None
    if not devices:
        raise MambaDebugError("--devices names nothing; give e.g. --devices cuda:0,cuda:1 or leave it out")
    names = tuple(_device_name(d) for d in devices)
    if engine == "llama.cpp":
        if device == "cpu" and len(names) > 1:
            raise MambaDebugError(f"--devices {','.join(names)}: llama.cpp's CPU build runs every layer on the CPU; "
                                  f"a split over several GPUs needs --device cuda and a CUDA build with that many "
                                  f"GPUs (--llama-lib)")
        bad = [n for n in names if not n.startswith("cuda:")]
        if bad and len(names) > 1:
            raise MambaDebugError(f"--devices {','.join(names)}: with --engine llama.cpp every device is a GPU of "
                                  f"the build, cuda:N (not {', '.join(bad)})")
        return names
    if device == "cuda":
        count = torch.cuda.device_count()
        for n in names:
            if not n.startswith("cuda:") or int(n[5:]) >= count:
                raise MambaDebugError(f"--devices {','.join(names)}: {n} is not one of this machine's {count} "
                                      f"GPU(s) (cuda:0..cuda:{count - 1}); with --device cuda list cuda:N devices")
        return names
    bad = [n for n in names if n != "cpu"]
    if bad:
        raise MambaDebugError(f"--devices {','.join(names)}: the device side runs on the CPU here (--device "
                              f"{device}), so every device must be a CPU stand-in: --devices cpu,cpu (or --device "
                              f"cuda for {', '.join(bad)})")
    return names


def _device_name(d) -> str:
    name = str(d).strip().lower()
    if name == "cuda":
        return "cuda:0"
    if name.startswith("cuda:") and not name[5:].isdigit():
        raise MambaDebugError(f"--devices: {d!r} is not a device name; give cuda:N (e.g. cuda:0,cuda:1) or cpu")
    if name != "cpu" and not name.startswith("cuda:"):
        raise MambaDebugError(f"--devices: unknown device {d!r}; give cuda:N (e.g. cuda:0,cuda:1) or cpu (a CPU "
                              f"stand-in)")
    return name


def resolve_ref_device(name: str) -> torch.device:
    """Where the reference sides' torch ops run: 'cpu' (the default) or 'cuda'. No silent fallback either."""
    if name not in REF_DEVICES:
        raise MambaDebugError(f"unknown reference device {name!r}: choose cpu (the default) or cuda (the reference "
                              f"sides' plain torch ops on the GPU)")
    if name == "cuda" and not torch.cuda.is_available():
        raise MambaDebugError("reference device 'cuda' was asked for but torch sees no GPU; use --ref-device cpu")
    return torch.device(name)
