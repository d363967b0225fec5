"""The OpenAI surfaces: completions, chat completions, the Responses API and embeddings, their
request bodies (pydantic), how each turns into one prepared submission, and the bodies and
event streams they send back."""
