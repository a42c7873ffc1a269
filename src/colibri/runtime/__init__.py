"""A loaded model: `Model` and `load`, the memory budget and its warm-up, perplexity."""
