"""Microbenchmarks and collectives that calibrate the performance model (needs torch)."""
