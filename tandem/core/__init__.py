"""CPU-side engine core: KV block bookkeeping, the scheduler and the step plan (no tensors here)."""
