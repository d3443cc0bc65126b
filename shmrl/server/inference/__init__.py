"""Server-side inference: the learner runs the policy for clients that send observations."""
