"""Benchmarks, the demo and (later) the evaluation harness: they drive real SGLang servers and report figures."""
