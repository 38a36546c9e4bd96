"""Live runs: start servers (`arms.py`), replay a workload against them (`driver.py`), one
command for both with interleaved repeats (`harness.py`, its replay order and setup in `protocol.py`), the
figures over repeats (`summary.py`) and the tables and plots (`report.py`, which also reads simulated
records). Not here: workloads (eval/workloads/), the simulator (eval/sim/) or benchmarks (eval/bench/).
"""
