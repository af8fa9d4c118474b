"""The model runner: packs a step's chunks into one batch and runs it (decode and mixed-step CUDA
graphs, their capture, KV cache memory sizing, the compile watch)."""
