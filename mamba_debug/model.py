"""A readable Mamba-1 whose every op goes through a back-end's op table, run the way llama.cpp runs it.

The layer graph and its site names are DESIGN.md's (llama.cpp order):

    norm -> xz -> (x, z views) -> conv (+ conv_state) -> conv_act -> dt, B, C -> y_scan (+ ssm_state)
         -> y_skip -> gate -> y_gated -> out -> resid            ... then final_norm -> logits

`Runner` holds per-layer conv and SSM states for S sequences, processes a prompt in ubatches of B
tokens (states read at the start of each ubatch, written back at its end), then generates one token
per ubatch. Layers chosen by the placement run on the device back-end, the rest on the host back-end;
the hidden state moves between them at the boundary. A `hook(layer, site, value, per_token)` sees
every site: `value` is [S, T, ...] (per_token=True) or, for states taken at the end of a ubatch only,
[S, ...] belonging to the ubatch's last token (per_token=False).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .backends import Backend, cpu_backend, cpu_threads_for, reference_backend
from .config import MambaConfig
from .errors import MambaDebugError
from .placement import Placement

LAYER_SITES = ("norm", "xz", "conv", "conv_state", "conv_act", "dt", "B", "C", "y_scan", "ssm_state",
               "y_skip", "gate", "y_gated", "out", "resid")
MODEL_SITES = ("final_norm", "logits")
STATE_SITES = ("conv_state", "ssm_state")
SITES = LAYER_SITES + MODEL_SITES

Hook = Callable[[Optional[int], str, torch.Tensor, bool], None]


class MambaModel:
    """Weights (float64 masters), config and tokenizer; `logits` runs the reference back-end."""

    def __init__(self, config: MambaConfig, params: dict[str, torch.Tensor], tokenizer=None, source: str = "",
                 notes=()):
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.source = source              # the path it was loaded from ("" in memory)
        self.notes = list(notes)          # what the loader could not carry over (e.g. a tokenizer it did not rebuild)
        self._cast: dict[tuple, dict[str, torch.Tensor]] = {}

    def __repr__(self) -> str:
        c = self.config
        return (f"MambaModel({self.source or 'in memory'}: L={c.n_layer} E={c.d_model} D={c.d_inner} "
                f"N={c.d_state} K={c.d_conv} R={c.dt_rank} V={c.vocab_size})")

    def weights(self, backend: Backend) -> dict[str, torch.Tensor]:
        """Parameters cast once per (device, dtype); shared by every run on that back-end."""
        if backend.key not in self._cast:
            self._cast[backend.key] = {k: v.to(device=backend.device, dtype=backend.dtype)
                                       for k, v in self.params.items()}
        return self._cast[backend.key]

    # -- tokenizer ---------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
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
        tokens = check_tokens(tokens, self.config.vocab_size)
        runner = runner or Runner(self, reference_backend())
        out = []
        with cpu_threads_for(self.config):
            nxt = runner.prefill(tokens, ubatch)[:, -1].argmax(-1)
            for _ in range(n_gen):
                out.append(nxt)
                nxt = runner.forward(nxt[:, None])[:, -1].argmax(-1)
        return torch.stack(out, dim=1) if out else tokens.new_zeros((tokens.shape[0], 0))


def check_tokens(tokens, vocab_size: int) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise MambaDebugError(f"tokens must be an integer tensor [S, P], got {tokens.dtype} {list(tokens.shape)}")
    if tokens.shape[1] == 0 or tokens.shape[0] == 0:
        raise MambaDebugError("the prompt is empty: give at least one token per sequence")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise MambaDebugError(f"token ids must lie in [0, {vocab_size}); got {int(tokens.min())}..{int(tokens.max())}")
    return tokens.long()


class Runner:
    """One placed execution of a model: host back-end below the boundary, device back-end from it on."""

    def __init__(self, model: MambaModel, host: Backend, device: Optional[Backend] = None,
                 placement: Optional[Placement] = None, hook: Optional[Hook] = None):
        cfg = model.config
        self.model, self.cfg, self.hook = model, cfg, hook
        self.placement = placement or Placement(cfg.n_layer, 0)
        if self.placement.n_device_layers or self.placement.head_on_device:
            if device is None:
                raise MambaDebugError("a placement with offloaded layers needs a device back-end")
        self.host, self.device = host, device or host
        self.layer_backends = [self.device if self.placement.on_device(i) else host for i in range(cfg.n_layer)]
        self.head_backend = self.device if self.placement.head_on_device else host
        self.layer_weights = [self._layer_weights(model.weights(b), i) for i, b in enumerate(self.layer_backends)]
        self.n_seqs = 0
        self.pos = 0              # tokens already processed per sequence
        self.ubatch_index = -1    # index of the ubatch being (or last) processed
        self.current_layer = None # block being run (None: embedding or head)

    @staticmethod
    def _layer_weights(w: dict, i: int) -> dict:
        p = f"layers.{i}."
        return {k[len(p):]: v for k, v in w.items() if k.startswith(p)}

    def reset(self, n_seqs: int):
        """Fresh zero states for n_seqs sequences, each on its layer's back-end."""
        c = self.cfg
        self.n_seqs, self.pos, self.ubatch_index = n_seqs, 0, -1
        self.conv_states, self.ssm_states = [], []
        for b in self.layer_backends:
            self.conv_states.append(torch.zeros(n_seqs, c.d_conv - 1, c.d_inner, dtype=b.dtype, device=b.device))
            self.ssm_states.append(torch.zeros(n_seqs, c.d_inner, c.d_state, dtype=b.dtype, device=b.device))

    def _site(self, layer, name, value, per_token=True):
        if self.hook is not None:
            self.hook(layer, name, value, per_token)

    # -- execution ---------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, ubatch: int) -> torch.Tensor:
        """Process a prompt [S, P] from fresh states in ceil(P/ubatch) ubatches; logits [S, P, V]."""
        tokens = check_tokens(tokens, self.cfg.vocab_size)
        if not isinstance(ubatch, int) or ubatch < 1:
            raise MambaDebugError(f"ubatch must be an integer >= 1 (like -ub), got {ubatch!r}")
        self.reset(tokens.shape[0])
        chunks = [self.forward(tokens[:, i:i + ubatch]) for i in range(0, tokens.shape[1], ubatch)]
        return torch.cat(chunks, dim=1)

    def forward(self, tokens: torch.Tensor, start_layer: int = 0, h_start: Optional[torch.Tensor] = None,
                feed: Optional[Callable] = None) -> torch.Tensor:
        """One ubatch [S, T] continuing from the current states; returns logits [S, T, V] (head's dtype).

        start_layer/h_start: skip the blocks below start_layer and start from their known output h_start
        (the engine shares host blocks between the two sides instead of computing them twice).
        feed(i, h, conv_state, ssm_state) -> (h, conv_state, ssm_state) may replace a block's input and
        states just before it runs (local-error mode: every device block gets the reference's inputs).
        """
        if tokens.shape[0] != self.n_seqs:
            raise MambaDebugError(f"ubatch has {tokens.shape[0]} sequences but the runner holds {self.n_seqs}")
        self.ubatch_index += 1
        if start_layer == 0:
            h = self.model.weights(self.host)["embed"][tokens.to(self.host.device)]  # get_rows on the host
        else:
            h = h_start
        for i in range(start_layer, self.cfg.n_layer):
            self.current_layer = i
            b = self.layer_backends[i]
            h = h.to(device=b.device, dtype=b.dtype)                                   # boundary crossing
            if feed is not None:
                h, self.conv_states[i], self.ssm_states[i] = feed(i, h, self.conv_states[i], self.ssm_states[i])
            h = self._layer(i, b, h)
        self.current_layer = None
        b = self.head_backend
        h = h.to(device=b.device, dtype=b.dtype)
        w = self.model.weights(b)
        final = b.ops.rms_norm(h, w["norm_f"], self.cfg.rms_eps)
        self._site(None, "final_norm", final)
        logits = b.ops.linear(final, w["lm_head"])
        self._site(None, "logits", logits)
        self.pos += tokens.shape[1]
        return logits

    def _layer(self, i: int, b: Backend, h: torch.Tensor) -> torch.Tensor:
        """One Mamba block on back-end b; h [S, T, E]. Views stay views (llama.cpp hands ops strided views)."""
        c, w, ops = self.cfg, self.layer_weights[i], b.ops
        D, N, R = c.d_inner, c.d_state, c.dt_rank
        site = lambda name, value, per_token=True: self._site(i, name, value, per_token)  # noqa: E731

        norm = ops.rms_norm(h, w["norm"], c.rms_eps);                 site("norm", norm)
        xz = ops.linear(norm, w["in_proj"], w.get("in_proj_bias"));   site("xz", xz)
        x, z = xz[..., :D], xz[..., D:]                                # strided views, row stride 2D
        conv, self.conv_states[i] = ops.ssm_conv(self.conv_states[i], x, w["conv_w"])
        conv = conv + w["conv_b"];                                     site("conv", conv)
        site("conv_state", self.conv_states[i], False)
        conv_act = ops.silu(conv);                                     site("conv_act", conv_act)
        dbc = ops.linear(conv_act, w["x_proj"])
        dt, B, C = dbc[..., :R], dbc[..., R:R + N], dbc[..., R + N:]   # strided views of one projection
        dt = ops.linear(dt, w["dt_proj"], w["dt_bias"]);               site("dt", dt)
        site("B", B)
        site("C", C)
        states = None
        if self.hook is not None and b.ops.supports_states_out:
            states = torch.empty(h.shape[0], h.shape[1], D, N, dtype=b.dtype, device=b.device)
        y_scan, self.ssm_states[i] = ops.ssm_scan(self.ssm_states[i], conv_act, dt, w["A"], B, C, states_out=states)
        site("y_scan", y_scan)
        if states is not None:
            # the last row is the state actually handed to the next ubatch, so a kernel that returns another
            # state than its last h_t is caught at the token where it happens
            states[:, -1] = self.ssm_states[i]
            site("ssm_state", states, True)
        else:
            site("ssm_state", self.ssm_states[i], False)
        y_skip = y_scan + conv_act * w["D"];                           site("y_skip", y_skip)
        gate = ops.silu(z);                                            site("gate", gate)
        y_gated = y_skip * gate;                                       site("y_gated", y_gated)
        out = ops.linear(y_gated, w["out_proj"], w.get("out_proj_bias")); site("out", out)
        resid = h + out;                                               site("resid", resid)
        return resid
