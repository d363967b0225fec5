"""Structured output: which request field asks for which grammar, the out-of-process check of a
grammar a client sent, and its compilation off the engine's step path."""
