"""Ingress security: the attack catalogue (`attacks.py`, data only, imported by tests) and its
stock-vs-ours runner (`run.py`, starts servers). Not here: correctness of adapter outputs (tests/)
or performance (eval/live/, eval/bench/).
"""
