"""What the test modules share, so that no test module imports another.

- `servers`: real uvicorn servers on loopback ports and the hooks tests put into their engines.
- `engine_runs`: requests run through an engine to completion (greedy, seeded, one by one).
- `model_files`: model files written by the tests (Hugging Face directories of random
  transformers models, GGUF files, a Gemma vocabulary).
- `family_models`: tiny random models of the newer families (Gemma 4, gpt-oss) and one byte-level
  tokenizer written both as a Hugging Face tokenizer and as a GGUF's metadata.
- `tiny_archs`: the tiny random configuration of each architecture, and what each one has.
- `oracles`: the independent computations tests compare with (transformers' logits, greedy
  tokens, log-probabilities).
- `kquant_rows`: random GGUF block rows and the reference arithmetic of the quantized kernels.
- `real_models`: the real model files (SmolLM2, Gemma 3 270M), fetched when missing.

Fixtures live in tests/conftest.py and are built from these.
"""
