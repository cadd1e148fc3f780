"""Where steps run: an executor holds the model runners (one process, or the ranks of a
tensor-parallel group), runs each StepPlan on them and returns rank 0's StepResult.

The engine talks to its runners only through an executor; `Executor.collective_rpc` runs any
ModelRunner operation on every rank, so a new operation needs no forwarder.
"""
