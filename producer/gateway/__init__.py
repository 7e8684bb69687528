"""The HTTP gateway: `batchgate gateway` (FastAPI), its schemas and /metrics."""
