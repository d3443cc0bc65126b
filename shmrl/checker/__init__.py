"""The conformance checker: a scripted RLlink server and its rules for a client under test."""
