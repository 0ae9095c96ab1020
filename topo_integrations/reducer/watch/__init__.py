"""The watch: who decides when a collective of the reducer has failed or timed out. It owns what a
failure is (`errors.CollectiveError`, the one error every collective ends in, naming op, group and
ranks), the timeout-thread runner for a blocking call outside the schedule (`bounded.bounded`),
completion (`completion.py`: when an issued collective's data has arrived on each backend, the
`Watch` that polls every collective in flight against ``fallback.timeout_s`` and aborts the
communicators, the CPU test double of NCCL's semantics), and the one way the reducer starts a helper
thread (`thread_device.start_thread`: on the starter's CUDA device and stream). It imports nothing
else of the reducer.
"""
