"""Where a tensor's bytes come from: the read path (io), the RAM and streaming stores, placement, expert usage."""
