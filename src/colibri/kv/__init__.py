"""The KV memory: the paged block pool, per-sequence caches, the prefix trie, swap to SSD, saved sessions."""
