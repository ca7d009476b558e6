"""Which tokens run next: requests and their status, the scheduler, KV pages (the block
allocator, prefix digests) and the limits a request is checked against."""
