"""The client side: the actor, its action sampler, the rollout, the simulator loops (no torch)."""
