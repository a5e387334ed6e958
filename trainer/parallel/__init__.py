"""Tensor and data parallelism: the process groups, the layers and autograd mappings, ZeRO and gradient buckets."""
