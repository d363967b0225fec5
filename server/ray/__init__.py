"""cbserve on Ray Serve: engine replicas behind a prefix-aware router (`pip install .[ray]`).

`python -m server.ray` runs two tiers: an ingress deployment serving the same FastAPI app as
`python -m server` (`server.http.app.create_app`) through `RayEngineClient`, and an engine deployment
whose replicas each own a model and an `AsyncEngineDriver`. `PrefixAwareRouter` sends requests
that share their first KV blocks to the same engine replica.

Nothing outside this package imports it, and importing this file imports no Ray: the
single-process server never needs Ray installed.

Modules: `keys` (route keys over prompt token ids), `wire` (what crosses the handle),
`router` (the `RequestRouter`), `replica` (the engine deployment), `client` (the ingress-side
`EngineClient`), `deploy` (building the Serve application), `cli` (`python -m server.ray`),
`disagg` (the prefill and decode deployments, whose engines are `engine.tiers`'). Only Ray lives
here: no engine is defined in this package.
"""
