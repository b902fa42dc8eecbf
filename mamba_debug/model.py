"""The model (float64 master weights, config, tokenizer) and the `Runner`, which runs it the way llama.cpp does.

The Runner is architecture-agnostic: each block's layer type (`arch/`) declares its states and runs the block; the
Runner allocates those states on the block's back-end, processes a prompt in ubatches of B tokens (states read at the
start of each ubatch, written back at its end), then one token per ubatch. Blocks chosen by the placement run on the
device back-end, the rest on the host back-end; the hidden state moves between them at the boundary.

What the outside sees goes through one `Observer` (every method optional):
    site(layer, name, value, per_token)   every site: value [S, T, ...] (per_token) or [S, ...] at the ubatch end
    op(layer, name, args, kwargs)         every op call, after it returned (export-case records them)
    before_layer(layer, h, states)        may replace a block's input and states just before it runs (local mode)
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .arch import MODEL_SITES, LayerContext, all_sites, layer_type
from .backends import Backend, cpu_backend, cpu_threads_for, reference_backend
from .config import ModelConfig, is_integer
from .errors import MambaDebugError
from .isolation import deferred
from .ops import OpTable
from .placement import Placement
from .settings_checks import check_n_gen


NARROW_FLOAT64_ON = ("cuda",)     # devices where the float64 reference keeps float32-valued weights as float32


class Model:
    """Weights (float64 masters), config and tokenizer; `logits` runs the reference back-end."""

    def __init__(self, config: ModelConfig, params: dict, tokenizer=None, source: str = "", notes=()):
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.source = source              # the path it was loaded from ("" in memory)
        self.notes = list(notes)          # what the loader could not carry over (e.g. a tokenizer it did not rebuild)
        self.file_state = None            # params_state() when the masters were read from `source` (a GGUF's loader)
        self._cast: dict = {}
        self._cast_state = None

    def __repr__(self) -> str:
        c = self.config
        kinds = "" if set(c.layer_types) == {"mamba1"} else "+".join(dict.fromkeys(c.layer_types)) + " "
        extra = f" H={c.n_heads} P={c.head_dim} G={c.n_groups}" if "mamba2" in c.layer_types else f" R={c.dt_rank}"
        return (f"MambaModel({self.source or 'in memory'}: {kinds}L={c.n_layer} E={c.d_model} D={c.d_inner} "
                f"N={c.d_state} K={c.d_conv}{extra} V={c.vocab_size})")

    def params_state(self) -> tuple:
        """What tells the masters' current values from earlier ones without reading them: each tensor's identity
        and its in-place version counter (an edit like `params[k] *= 3` bumps it)."""
        return tuple((k, id(t), t._version) for k, t in self.params.items())

    def fresh_casts(self):
        """Drop the back-ends' cached copies of the weights when a master changed since they were cast (an edit
        between two runs was read by one reference and not by the other)."""
        state = self.params_state()
        if state != self._cast_state:
            self._cast.clear()
            self._cast_state = state

    def release_casts(self, keep: Optional[torch.device] = None):
        """Drop the back-ends' cached copies of the weights (room on a GPU for another model's run), all but the float32
        references' copy on `keep` when given; the next run casts again what went."""
        kept = {k: v for k, v in self._cast.items() if keep is not None and k == ("narrowed", str(keep))}
        self._cast.clear()
        self._cast.update(kept)

    def float32_on(self, device: torch.device) -> tuple:
        """(the float32 references' copy of every master on `device`, the names of the masters that are not float32
        values), as the references' runs use and keep it (`_narrowed`)."""
        return self._narrowed(device)

    def weights(self, backend: Backend) -> dict:
        """Parameters in the back-end's dtype on its device (widened here when they are stored narrow)."""
        w, widen = self.stored_weights(backend)
        return {k: v.to(backend.dtype) for k, v in w.items()} if widen else w

    def stored_weights(self, backend: Backend) -> tuple:
        """(parameters as kept for the back-end, whether to widen them to its dtype where they are used); cast
        once per (back-end, device, dtype) and shared by every run on that back-end.

        On a GPU, the float64 reference keeps the float32 reference's copy of every master that is a float32 value
        (every tensor a checkpoint stores: f32, f16 and bf16 widen exactly) and a float64 copy of the others (A =
        -exp(A_log), computed in float64 from a transformers checkpoint): ~8 bytes a parameter on the GPU with the
        device's own float32 copy, instead of 16 (2.8B: 22 GB less; `budget.comparison_gpu_bytes` counts it so, within
        1% of the measured peaks). The Runner widens one block's weights at a time, which gives the same bits."""
        if backend.device.type in NARROW_FLOAT64_ON and backend.dtype in (torch.float32, torch.float64) \
                and backend.name in ("cpu", "reference"):
            narrow, wide = self._narrowed(backend.device)
            if backend.dtype == torch.float32:
                return narrow, False
            if not wide:
                return narrow, True
            if backend.key not in self._cast:
                self._cast[backend.key] = {k: self.params[k].to(backend.device) if k in wide else v
                                           for k, v in narrow.items()}
            return self._cast[backend.key], True
        if backend.key not in self._cast:
            refs = self._cast.get(("narrowed", str(backend.device)))
            if refs is not None and backend.dtype == torch.float32:
                # the float32 references' copy on this device, cloned there: the same bits (one rounding of the same
                # masters), tensors of its own (a device side never shares a weight tensor with a reference), and no
                # second upload of the float64 masters (a 2.8B model: ~3 s of a first comparison)
                self._cast[backend.key] = once_per_tensor(refs[0], torch.Tensor.clone)
            else:
                self._cast[backend.key] = once_per_tensor(
                    self.params, lambda v: v.to(device=backend.device, dtype=backend.dtype))
        return self._cast[backend.key], False

    def _narrowed(self, device) -> tuple:
        """The float32 references' weights on `device`, and the names of the masters that are not float32 values,
        from one upload of each master (torch's float64-to-float32 cast onto a GPU uploads the float64 values too,
        so the check costs no transfer of its own). Only the float64 reference uploads those masters again."""
        key = ("narrowed", str(device))
        if key not in self._cast:
            def upload(v):
                g = v.to(device)
                n = g.to(torch.float32)
                return n, _wide(g, n)
            both = once_per_tensor(self.params, upload)
            self._cast[key] = ({k: n for k, (n, _) in both.items()}, frozenset(k for k, (_, w) in both.items() if w))
        return self._cast[key]

    def wide_elements(self) -> int:
        """Elements of the weights (a tied tensor once) that are not float32 values: what the float64 reference keeps
        in float64 on a GPU (`_narrowed`). A pass over every master on the host, taken only when the GPU estimate
        that counts every weight as such does not fit (`budget.check_gpu_memory`)."""
        distinct = {id(v): v for v in self.params.values()}.values()
        return sum(v.numel() for v in distinct if _wide(v, v.to(torch.float32)))

    @property
    def sites(self) -> tuple:
        return all_sites(self.config)

    # -- tokenizer ---------------------------------------------------------------------------------
    def encode(self, text: str) -> list:
        if not isinstance(text, str):
            raise MambaDebugError(f"encode takes text (a str), got a {type(text).__name__}")
        if self.tokenizer is None:
            raise MambaDebugError(f"{self.source or 'this model'} has no tokenizer.json; pass token ids instead")
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode([int(i) for i in ids])

    # -- public entry points -----------------------------------------------------------------------
    def logits(self, tokens: torch.Tensor, *, ubatch: Optional[int] = None, backend: str = "reference") -> torch.Tensor:
        """Reference logits [S, P, V] for tokens [S, P] (float64 on the CPU unless backend='cpu')."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        host = reference_backend() if backend == "reference" else cpu_backend()
        runner = Runner(self, host)
        with cpu_threads_for(self.config):
            return runner.prefill(tokens, ubatch or tokens.shape[1])

    def generate(self, tokens: torch.Tensor, n_gen: int, *, ubatch: int = 512, runner: "Runner | None" = None):
        """Greedy continuation: returns the new token ids [S, n_gen]."""
        check_n_gen(n_gen, "n_gen")
        tokens = check_tokens(tokens, self.config.vocab_size)
        runner = runner or Runner(self, reference_backend())
        out = []
        with cpu_threads_for(self.config):
            nxt = runner.prefill(tokens, ubatch)[:, -1].argmax(-1)
            for _ in range(n_gen):
                out.append(nxt)
                nxt = runner.forward(nxt[:, None])[:, -1].argmax(-1)
        return torch.stack(out, dim=1) if out else tokens.new_zeros((tokens.shape[0], 0))


MambaModel = Model     # the name before the restructure


def _wide(master: torch.Tensor, rounded: torch.Tensor) -> bool:
    """Is this master not a float32 value (its float32 rounding `rounded` differs)? Such a weight the float64
    reference keeps in float64 on a GPU."""
    return master.dtype == torch.float64 and not torch.equal(rounded.to(torch.float64), master)


def once_per_tensor(params: dict, fn) -> dict:
    """{name: fn(tensor)} with fn called once per distinct tensor: names that share one (tied embeddings: `embed`
    and `lm_head`) share its result, as they share the master (one upload and one copy on a GPU, not two)."""
    done: dict = {}
    return {k: done[id(v)] if id(v) in done else done.setdefault(id(v), fn(v)) for k, v in params.items()}


def require_model(model, fn: str) -> None:
    """A public function's model argument, refused naming the function (an AttributeError on None before)."""
    if not isinstance(model, Model):
        raise MambaDebugError(f"{fn} takes a model (md.load_model() or md.build_model(...)), got a "
                              f"{type(model).__name__}")


def prompt_list(prompt_ids) -> list:
    """One prompt's token ids as a list of ints, from a list, tuple, iterator, 1-D array or tensor of integers (the
    API's `prompt_ids`); text, several rows, non-integers and ids beyond int64 are refused naming what was given."""
    if isinstance(prompt_ids, (str, bytes)):
        raise MambaDebugError("prompt_ids is text; pass token ids, e.g. model.encode(text)")
    if hasattr(prompt_ids, "ndim") and hasattr(prompt_ids, "tolist"):     # a tensor or numpy array
        if prompt_ids.ndim != 1:
            raise MambaDebugError(f"prompt_ids must be one prompt, a 1-D list of token ids; got shape "
                                  f"{list(prompt_ids.shape)} (several sequences come from n_seqs)")
        prompt_ids = prompt_ids.tolist()
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise MambaDebugError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}") from None
    for x in ids:
        if not _is_integer(x):
            raise MambaDebugError(f"prompt_ids must be integer token ids, got {x!r} ({type(x).__name__})")
        if not -2 ** 63 <= int(x) < 2 ** 63:
            raise MambaDebugError(f"token id {int(x)} is out of range")
    return [int(x) for x in ids]


def _is_integer(x) -> bool:
    """A Python, numpy or 0-d torch integer (not a bool)."""
    if isinstance(x, torch.Tensor):
        return x.ndim == 0 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool
    return is_integer(x)


def check_tokens(tokens, vocab_size: int) -> torch.Tensor:
    if isinstance(tokens, (str, bytes)):
        raise MambaDebugError("tokens are text; pass token ids, e.g. model.encode(text)")
    if not isinstance(tokens, torch.Tensor):
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise MambaDebugError(f"tokens must be token ids [S, P] (ints), got {type(tokens).__name__}: "
                                  f"{exc}") from None
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise MambaDebugError(f"tokens must be an integer tensor [S, P], got {tokens.dtype} {list(tokens.shape)}")
    if tokens.shape[1] == 0 or tokens.shape[0] == 0:
        raise MambaDebugError("the prompt is empty: give at least one token per sequence")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise MambaDebugError(f"token ids must lie in [0, {vocab_size}); got {int(tokens.min())}..{int(tokens.max())}")
    return tokens.long()


def _on(device: torch.device):
    """A block's ops run with its GPU current (Triton launches on the current device); nothing for the CPU."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class _ObservedOps:
    """An op table that tells the observer about every call of one layer (export-case records them)."""

    def __init__(self, table: OpTable, layer, observer):
        self._table, self._layer, self._observer = table, layer, observer
        self.supports_states_out = table.supports_states_out

    def __getattr__(self, name):
        fn = getattr(self._table, name)

        def called(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._observer.op(self._layer, name, args, kwargs)
            return out
        return called


class Runner:
    """One placed execution of a model: host back-end below the boundary, device back-end from it on."""

    def __init__(self, model: Model, host: Backend, device=None,
                 placement: Optional[Placement] = None, observer=None):
        """device: one Backend, or one per device slot of the placement (--devices)."""
        require_model(model, "Runner")
        for b in [host] + (list(device) if isinstance(device, (list, tuple)) else [device]):
            if b is not None and not isinstance(b, Backend):
                raise MambaDebugError(f"Runner: a back-end must be a md.Backend (md.reference_backend(), "
                                      f"md.device_backend(...)), got a {type(b).__name__}")
        if host is None:
            raise MambaDebugError("Runner needs a host back-end, e.g. md.reference_backend()")
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.placement = placement or Placement(cfg.n_layer, 0)
        if self.placement.n_device_layers or self.placement.head_on_device:
            if device is None:
                raise MambaDebugError("a placement with offloaded layers needs a device back-end")
        self.devices = list(device) if isinstance(device, (list, tuple)) else [device or host]
        if len(self.devices) != self.placement.n_slots:
            raise MambaDebugError(f"the placement has {self.placement.n_slots} device slot(s) but the runner got "
                                  f"{len(self.devices)} device back-end(s)")
        self.host, self.device = host, self.devices[0]
        self.layer_slots = self.placement.layer_slots
        self.head_slot = self.placement.head_slot
        self.layer_backends = [host if k is None else self.devices[k] for k in self.layer_slots]
        self.head_backend = host if self.head_slot is None else self.devices[self.head_slot]
        self.layer_types = [layer_type(cfg, i) for i in range(cfg.n_layer)]
        model.fresh_casts()
        stored = [model.stored_weights(b) for b in self.layer_backends]
        self.layer_weights = [self._layer_weights(w, i) for i, (w, _) in enumerate(stored)]
        self.layer_widen = [widen for _, widen in stored]      # widened one block at a time as it runs
        self.observer = observer
        self.n_seqs = 0
        self.pos = 0              # tokens already processed per sequence
        self.states: list = []    # per layer: state name -> tensor [S, ...] on the layer's back-end

    @staticmethod
    def _layer_weights(w: dict, i: int) -> dict:
        p = f"layers.{i}."
        return {k[len(p):]: v for k, v in w.items() if k.startswith(p)}

    def reset(self, n_seqs: int):
        """Fresh zero states for n_seqs sequences, each on its layer's back-end."""
        self.n_seqs, self.pos = n_seqs, 0
        self.states = [{spec.name: torch.zeros((n_seqs,) + tuple(spec.shape(self.cfg)), dtype=b.dtype,
                                               device=b.device) for spec in lt.states}
                       for lt, b in zip(self.layer_types, self.layer_backends)]

    @property
    def observer(self):
        return self._observer

    @observer.setter
    def observer(self, observer):
        self._observer = observer
        self._on_site = getattr(observer, "site", None)

    def _site(self, layer, name, value, per_token=True):
        if self._on_site is not None:
            self._on_site(layer, name, value, per_token)

    # -- execution ---------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, ubatch: int) -> torch.Tensor:
        """Process a prompt [S, P] from fresh states in ceil(P/ubatch) ubatches; logits [S, P, V]."""
        tokens = check_tokens(tokens, self.cfg.vocab_size)
        if not _is_integer(ubatch) or ubatch < 1:
            raise MambaDebugError(f"ubatch must be an integer >= 1 (like -ub), got {ubatch!r}")
        ubatch = int(ubatch)
        self.reset(tokens.shape[0])
        chunks = [self.forward(tokens[:, i:i + ubatch]) for i in range(0, tokens.shape[1], ubatch)]
        return torch.cat(chunks, dim=1)

    def forward(self, tokens: torch.Tensor, resume: Optional[tuple] = None) -> torch.Tensor:
        """One ubatch [S, T] continuing from the current states; returns logits [S, T, V] (head's dtype).

        resume=(layer, h): skip the blocks below `layer` and start from their known output h (a side that shares its
        host blocks with another side's run starts at its boundary instead of computing them twice).
        A plug-in op's inputs on a GPU are checked for writes once, at the end (isolation.deferred). No autograd: a
        plug-in's output that requires grad would stop the reference ops that write into `out=` buffers."""
        with deferred(), torch.no_grad():
            return self._forward(tokens, resume)

    def _forward(self, tokens: torch.Tensor, resume: Optional[tuple]) -> torch.Tensor:
        if tokens.shape[0] != self.n_seqs:
            raise MambaDebugError(f"ubatch has {tokens.shape[0]} sequences but the runner holds {self.n_seqs}")
        start, h = resume if resume is not None else (0, None)
        if start == 0:
            h = self.embed(tokens)
        before = getattr(self.observer, "before_layer", None)
        src = self.layer_slots[start - 1] if start > 0 else None     # the device slot h comes from (None: host)
        for i in range(start, self.cfg.n_layer):
            b, dst = self.layer_backends[i], self.layer_slots[i]
            h = self._cross(h, src, dst, b)                                            # boundary crossing
            if before is not None:
                h, self.states[i] = before(i, h, self.states[i])
            with _on(b.device):
                h = self.layer_types[i].layer(self._context(i, b), h)
            src = dst
        return self._head(h, tokens.shape[1], src)

    @staticmethod
    def _cross(h: torch.Tensor, src: Optional[int], dst: Optional[int], b: Backend) -> torch.Tensor:
        """The hidden state into block (or head) on back-end b: from one device slot to another it is the receiving
        back-end's `transfer` op (a plug-in may override it); host | device stays a plain cast."""
        if src is not None and dst is not None and src != dst:
            with _on(b.device):
                return b.ops.transfer(h, b.device)
        return h.to(device=b.device, dtype=b.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """get_rows on the host, times the config's embedding multiplier (Granite) when it is not 1."""
        w, widen = self.model.stored_weights(self.host)
        h = w["embed"][tokens.to(self.host.device)]
        h = h.to(self.host.dtype) if widen else h          # the rows, widened: the same bits as widening first
        m = self.cfg.embedding_multiplier
        return h if m == 1.0 else h * m

    def _context(self, i: int, b: Backend) -> LayerContext:
        ops = b.ops if not hasattr(self.observer, "op") else _ObservedOps(b.ops, i, self.observer)
        w = self.layer_weights[i]
        w = {k: v.to(b.dtype) for k, v in w.items()} if self.layer_widen[i] else w
        return LayerContext(index=i, cfg=self.cfg, ops=ops, w=w, states=self.states[i],
                            site=lambda name, value, per_token=True: self._site(i, name, value, per_token),
                            want_states_out=self._on_site is not None and b.ops.supports_states_out,
                            dtype=b.dtype, device=b.device)

    def _head(self, h: torch.Tensor, T: int, src: Optional[int] = None) -> torch.Tensor:
        b = self.head_backend
        h = self._cross(h, src, self.head_slot, b)
        w, widen = self.model.stored_weights(b)
        w = {k: w[k].to(b.dtype) for k in ("norm_f", "lm_head")} if widen else w
        ops = b.ops if not hasattr(self.observer, "op") else _ObservedOps(b.ops, None, self.observer)
        with _on(b.device):
            final = ops.rms_norm(h, w["norm_f"], self.cfg.rms_eps)
            self._site(None, MODEL_SITES[0], final)
            logits = ops.linear(final, w["lm_head"])
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        self._site(None, MODEL_SITES[1], logits)
        self.pos += T
        return logits

    # -- states ------------------------------------------------------------------------------------
    def save_states(self) -> list:
        """A copy of every layer's states (ops may later write into the tensors they were handed)."""
        return [{k: v.clone() for k, v in st.items()} for st in self.states]

    def load_states(self, states: list):
        self.states = [{k: v.clone() for k, v in st.items()} for st in states]
