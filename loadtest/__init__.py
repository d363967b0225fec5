"""Load testing over HTTP: workload traces, the open-loop generator, metrics, reports and plots.

It imports nothing from `server`, `engine` or `models`, so it measures any OpenAI-compatible server
the same way. Modules: `trace` (what is sent and when), `runner` (sending it and timing every
streamed chunk), `metrics` (TTFT, ITL, TPOT, E2E, throughput, goodput), `report` (printed block,
JSON, markdown, plots), `sweep` (runs and engine x rate sweeps; starts our server as a subprocess).
Command line: `python -m loadtest run|sweep --help`.
"""

from loadtest.metrics import SLO, RequestRecord, Summary, summarize
from loadtest.runner import RunResult, run_trace
from loadtest.trace import Trace, TraceRequest, TraceSpec, build_trace

__all__ = [
    "SLO",
    "RequestRecord",
    "RunResult",
    "Summary",
    "Trace",
    "TraceRequest",
    "TraceSpec",
    "build_trace",
    "run_trace",
    "summarize",
]
