"""The decoder and its blocks (attention, RoPE, MLP and experts, latent attention, gated DeltaNet)."""
