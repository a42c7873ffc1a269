"""Checkpoint readers. Each exposes: config (HF-style dict), tensor_names(), tensor_shape(name), load(name),
and the tokenizer pieces (tokenizer, chat_template, special). Tensors come back under HF names and layouts."""
