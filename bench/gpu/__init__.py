"""GPU experiments (not part of the kvdir product): a minimal paged-KV engine
and the prefill-versus-fetch experiment of docs/gpu.md."""
