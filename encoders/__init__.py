"""Multimodal encoders: media decode (nvJPEG via cupy on GPU, CPU fallback), the vision tower,
the content-hash embedding cache and the encoder service. Imports nothing above it."""

__all__: list[str] = []
