"""The learner's networks and algorithms, in torch."""
