"""Speculative decoding: proposers (n-gram lookup, a draft model) and the speculator that
plans, proposes and verifies within the decode step."""
