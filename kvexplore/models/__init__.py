"""The decoder and its blocks (attention, RoPE, MLP and experts, latent attention, gated DeltaNet), and one module
per architecture family (:mod:`.architectures`) saying which blocks and config fields each architecture uses."""
