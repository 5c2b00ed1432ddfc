"""Rollout side: vLLM engine actors, the pool that drives them, the throughput benchmark."""
