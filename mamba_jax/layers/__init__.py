"""The layer kinds (registry.KINDS: Mamba2, attention, MLP) and the blocks they share
(common)."""
