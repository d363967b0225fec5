"""The one generation loop every surface hands its prepared submission to: the engine requests
submitted, each output turned into text (stop strings, usage), streamed as SSE or returned
whole, who a request comes from, and the metrics it is counted in."""
