"""`trtspec serve`: an OpenAI-compatible HTTP server on the batched runtime (app.py, server.py)."""
