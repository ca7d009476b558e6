"""Running a batch on the device: the KV pool, persistent slots, graph capture and replay,
the prefill and decode runners, sampling, and the compile configuration they are built by."""
