"""Sampling loops written the way diffusion projects write them (small sizes), for the rewrite's tests."""
