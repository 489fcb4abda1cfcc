"""Measuring tools users can run on their own training step, on the CPU.

- `write_counter`: `WriteCounter` (bytes every op writes, by who wrote them), `CopyCounter`,
  `LaunchCounter`, `FSDPPaths` ([Note: what WriteCounter counts]).
- `peer_traffic`: `PeerTraffic`, the bytes a rank receives from other ranks in its collectives.
- `memory`: `tracked_step`, `estimate`, `fits` (peak memory of a step by kind and phase with
  torch's MemTracker; one-process FakeTensorMode estimates at N ranks;
  `python -m veragged.tools.memory`).
- `happens_before`: `Recorder`, a vector-clock checker of fully_shard's stream orderings
  ([Note: streams and events]).
"""
