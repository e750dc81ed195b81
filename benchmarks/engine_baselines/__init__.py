"""Benchmark baselines: the serving engines' own decode kernels, loaded at run time from `.baselines/`."""
