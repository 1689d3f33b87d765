"""Backends: eager, cpu (recording graph), cuda, npu (ACL), xla; one file each over shared code."""
