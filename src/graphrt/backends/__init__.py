"""Backends: ``base`` states what every backend implements; ``torch/`` (cuda, npu, cpu,
eager over one executor) and ``xla/`` implement it."""
