"""In-process command-line tools: benchmarks, the batching demo and trace replay.

    python -m tools.demo            static vs continuous batching, side by side
    python -m tools.bench_engine    engine decode throughput at several batch sizes
    python -m tools.bench_model     the decoder alone on a real checkpoint, against machine peaks
    python -m tools.replay          a timed trace replayed against an engine, no HTTP

Unlike the library packages these may import anything (engine, models, loadtest's traces and
metrics); nothing imports them. The HTTP-side load tool is `python -m loadtest`.
"""
