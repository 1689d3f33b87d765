"""Reference models (torch and JAX) that run under graphrt's ModelRunner.

Submodules import torch or jax; this package itself imports neither.
"""
