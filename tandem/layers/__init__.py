"""The model's layer operations and the kernels behind them: projections (`linear`), attention over the paged KV
cache (`attention`), the `LayerOps` seam with its torch and fused-CPU-kernel implementations (`ops`), and the build
of those kernels (`kernels`, `csrc/`). Imported by the models; imports neither the models nor the runner."""
