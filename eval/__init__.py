"""Evaluation, one folder per kind: live runs against servers (`live/`), benchmarks (`bench/`),
ingress security (`security/`), the GPU-scale simulator (`sim/`) and the workload generators with
their request records (`workloads/`); `demo.py` is `make demo`. Data sets live in `data/`, results
in `results/`. The package sgl_multilora never imports anything from here.
"""
