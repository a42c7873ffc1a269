"""Checkpoint readers: `checkpoint.Checkpoint` is the surface every reader offers (config, tensors under HF names
and layouts, tokenizer pieces) and `checkpoint.open_checkpoint` picks the reader a path needs: `hf` (an HF
directory of safetensors), `gguf` (a .gguf file, dequantized), or the Colibri container (colibri.container)."""
