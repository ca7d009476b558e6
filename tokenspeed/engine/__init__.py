"""The engine: each step schedules a batch (``scheduling``), launches it on the runners
(``execution``) and reads the step before; speculative decoding's drafts and windows."""
