"""Helpers for loadtest's tests and benchmark: a fake streaming LLM server run in its own process,
its launcher, and timing checks for a shared machine."""
