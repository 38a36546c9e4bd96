"""Benchmarks, one script per experiment, each writing JSON lines to eval/results/<experiment>/: LoRA kernels,
CPU extend attention, tree overhead and the multi-adapter pipeline. Not here: workload replay
against servers (eval/live/) or the simulator (eval/sim/).
"""
