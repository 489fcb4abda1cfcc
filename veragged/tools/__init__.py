"""Measuring tools users can run on their own training step, on the CPU.

- `write_counter`: `WriteCounter` (bytes every op writes, by who wrote them), `CopyCounter`,
  `LaunchCounter`, `FSDPPaths` ([Note: what WriteCounter counts]).
- `peer_traffic`: `PeerTraffic`, the bytes a rank receives from other ranks in its collectives.
- `happens_before`: `Recorder`, a vector-clock checker of fully_shard's stream orderings
  ([Note: streams and events]).
"""
