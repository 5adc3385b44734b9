"""An OpenAI-compatible HTTP server over chunkwise.Engine: `python -m chunkwise serve --model M`.

One file per job: `protocol.py` (request models with OpenAI's fields, the error object, response shapes),
`client.py` (the server's side of the engine: validation, text, stop strings, routing), `driver.py` (the engine's
side: the one loop between steps), `messages.py` (what crosses between them), `streams.py` (each request's
asyncio queue and the token timings), `engine_loop.py` / `engine_core.py` (the two transports: a thread, a
process), `chat.py` (chunk content parts), `metrics.py` (Prometheus), `app.py` (the FastAPI routes), `cli.py` (the
command line and uvicorn, with Ctrl-C / SIGTERM aborting in-flight requests).
"""
