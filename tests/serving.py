"""A test server over an engine on a free 127.0.0.1 port, run by a thread (shared by the server tests)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from chunkwise.serve.cli import make_server


@contextmanager
def serving(engine, model: str):
    """The running server (uvicorn's, with `.url` its address); stops it and closes the engine on exit."""
    srv = make_server(engine, model, port=0, log_level="warning")
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    srv.url = f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    try:
        yield srv
    finally:
        srv.should_exit = True
        thread.join(30)
        srv.state.loop.stop()
        engine.close()
