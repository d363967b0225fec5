"""Grammars a client sends: checked out of process first (`checker`, the server's side; and
`check_worker`, the process), then compiled off the engine's step path (`compiler`)."""
