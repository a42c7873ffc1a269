"""Quantized kinds: the byte layouts every tier reads (kinds) and the fitting of their scales (fit)."""
