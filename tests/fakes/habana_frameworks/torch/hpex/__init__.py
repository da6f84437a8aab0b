"""Fake habana_frameworks.torch.hpex (Habana's extra kernels)."""
