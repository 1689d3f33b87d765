"""The embedded serving engine: scheduler and block allocator behind graphrt.LLM."""
