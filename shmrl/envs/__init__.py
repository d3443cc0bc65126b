"""Environments: specs, the built-in ones, gymnasium's and PettingZoo's."""
