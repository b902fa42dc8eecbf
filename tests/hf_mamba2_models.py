"""Random transformers Mamba-2 and Granite-4.0-H-style dense hybrid models (test helpers; configs drawn per seed)."""
from __future__ import annotations

import random

import torch


def draw_mamba2_config(seed: int):
    from transformers import Mamba2Config
    r = random.Random(seed)
    G = r.choice([1, 2, 4])
    H = G * r.choice([1, 2, 3])
    P = r.choice([4, 8])
    E = r.choice([e for e in (8, 12, 16, 24, 32, 48) if (H * P) % e == 0 and H * P // e in (1, 2, 3, 4)] or [H * P // 2])
    return Mamba2Config(vocab_size=r.choice([50, 61, 64]), hidden_size=E, expand=H * P // E, num_heads=H, head_dim=P,
                        n_groups=G, state_size=r.choice([4, 8, 16]), conv_kernel=r.choice([2, 3, 4]),
                        chunk_size=r.choice([3, 4, 5, 8]), num_hidden_layers=r.choice([1, 2, 3]),
                        tie_word_embeddings=r.random() < 0.5, use_conv_bias=r.random() < 0.8,
                        layer_norm_epsilon=r.choice([1e-5, 1e-6]), pad_token_id=0, bos_token_id=0, eos_token_id=0)


def draw_granite_config(seed: int):
    from transformers import GraniteMoeHybridConfig
    r = random.Random(seed)
    L = r.choice([2, 3, 4])
    kinds = [r.choice(["mamba", "attention"]) for _ in range(L)]
    kinds[r.randrange(L)] = "mamba"
    G = r.choice([1, 2])
    H = G * r.choice([2, 4])
    P = 8
    E = H * P // 2
    Ha = r.choice([2, 4])
    return GraniteMoeHybridConfig(
        vocab_size=r.choice([50, 64]), hidden_size=E, num_hidden_layers=L, num_attention_heads=Ha,
        num_key_value_heads=r.choice([k for k in (1, 2, Ha) if Ha % k == 0]), shared_intermediate_size=r.choice([24, 40]),
        num_local_experts=0, layer_types=kinds, mamba_n_heads=H, mamba_n_groups=G, mamba_d_state=r.choice([4, 8]),
        mamba_d_head=P, mamba_d_conv=r.choice([3, 4]), mamba_chunk_size=r.choice([4, 5]),
        embedding_multiplier=r.uniform(1, 4), residual_multiplier=r.uniform(0.2, 1),
        attention_multiplier=r.uniform(0.1, 0.5), logits_scaling=r.uniform(1, 3), position_embedding_type="nope",
        tie_word_embeddings=r.random() < 0.5, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def build(config, seed: int):
    """The transformers model with every parameter randomised (default init leaves A_log, D, norms regular)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("A_log", "dt_bias", "D")) or "norm" in n or "conv1d.bias" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


def hf_logits(m, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=ids, use_cache=False).logits.double()
