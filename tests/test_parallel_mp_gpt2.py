"""Multiprocess executor (gloo), GPT-2 family: see parallel_mp_cases.py."""

FAMILY = "gpt2"

from parallel_mp_cases import *  # noqa: E402,F401,F403
