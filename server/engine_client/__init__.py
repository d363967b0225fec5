"""The seam between the HTTP edge and an engine: the `EngineClient` interface and its output
streams, the in-process driver that implements it, and grammars that cross to an engine in
another process (Ray Serve replicas)."""
