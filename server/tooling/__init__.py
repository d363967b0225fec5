"""Tool calling: the tool-call formats (one table row each), a request's tool plan, the chat
template that renders the conversation with its tools, and the parsers that turn a choice's text
back into reasoning, content and tool calls."""
