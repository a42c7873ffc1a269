"""Files in and out: the checkpoint protocol over HF and GGUF, Colibri's container, tokenizers."""
