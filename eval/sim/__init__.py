"""GPU-scale discrete-event simulator of multi-LoRA serving (all figures it produces are simulated).

Lives here: the latency model (`latency.py`), memory accounting (`memory.py`), ELORA's host KV tier
(`hostkv.py`), token sequences of a workload (`tokens.py`), the event loop with continuous batching
(`engine.py`), the compared systems (`systems/`), admission policies (`admission/`: fcfs, lpm and the real
`sgl_multilora.sched.MultiQueueScheduler`), the ELORA-style experiment (`compare.py`) and Chameleon's scheduling
comparison (`sched_compare.py`), and the MoE-scale comparison of InfiniLoRA's disaggregated LoRA server against
coupled serving (`moe_compare.py`; its latency model `moe_latency.py`, its systems `systems/moe.py`, several
instances on one clock through `engine.simulate_systems`). The systems drive the project's own core objects
(`sgl_multilora.tree.LoraRadixTree`, `sgl_multilora.policy`); nothing here imports sglang.

Entry point for other tools: `eval.sim.engine.simulate(arm, adapters, requests, experiment=...)` returns a
`SimRun` whose `results` are `RequestResult`s (extra["simulated"] is True) and whose `samples` are memory by
kind over time; arm names are listed in `eval/sim/systems/__init__.py`.
"""
