"""Pallas kernels with no model knowledge. `pallas_kernels.ssd.ssd` is the SSD scan."""
