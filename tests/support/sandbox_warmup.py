"""Imported by the sandbox's forkserver only: run torch's first-use initialisation once, on one thread (no
OpenMP pool exists yet, so forking stays safe), so that each forked case starts warm instead of paying ~2 s."""

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
with torch.no_grad():
    x = torch.randn(1, 4, 3, 8)
    F.scaled_dot_product_attention(x, x, x, is_causal=True)
    F.linear(torch.randn(2, 8), torch.randn(16, 8)).softmax(-1)
    torch.multinomial(torch.rand(16), 1, generator=torch.Generator().manual_seed(0))
    torch.nn.Embedding(10, 8)(torch.tensor([[1, 2]]))
    with torch.device("meta"):  # the loader builds modules on the meta device: its first use imports torch._refs
        torch.nn.Embedding(10, 8)
        torch.nn.Linear(8, 8)
