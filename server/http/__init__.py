"""The HTTP plumbing: the FastAPI app and its routes, the guards in front of them, the server
options both command lines share, the OpenAPI document as served, the web page, and the uvicorn
server `python -m server` runs."""
