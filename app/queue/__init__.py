"""Queues over Redis: key schema, scripts, submit/claim/ack/cancel, dispatcher, registry."""
