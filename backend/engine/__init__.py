"""The engine: one step (`step`), the executor that loops it, and what turns a step's tokens into
outputs (output processing, stopping, limits, statistics)."""
