"""Tensor and data parallelism over torch.distributed: rank 0's executor, the workers it drives, their channel and rendezvous."""
