"""Chaos testing of the directory: faults on a schedule, a recorded history, a checker.

- `history`: the operation and fault records every run writes (JSON lines).
- `checker`: pure checks over a history (linearizability per key, lost
  acknowledged writes, local-read monotonicity and staleness, lease expiry,
  convergence, unavailability per fault).
- `netns`: replicas in network namespaces joined by veth pairs to a bridge.
- `workload`: the agent, reader and crashing-agent processes.
- `run`: the fault schedule and the `kvdir chaos` command.
"""
