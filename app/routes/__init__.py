"""FastAPI routers: thin; the work happens in app.queue and friends."""
