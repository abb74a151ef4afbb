"""Multiprocess executor (gloo), Llama family with GQA (4 heads, 2 KV heads): see parallel_mp_cases.py."""

FAMILY = "llama"

from parallel_mp_cases import *
