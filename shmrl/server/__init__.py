"""The learner's serving side: the hub, serving thread, episode store, recorder, server-side inference."""
