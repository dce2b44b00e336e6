"""The baseline for the submit benchmark: a trivial FastAPI route that makes one Redis call."""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.asyncio import Redis

app = FastAPI()
redis = Redis.from_url(sys.argv[2], decode_responses=True)


@app.post("/api/v1/tasks")
async def submit(request: Request) -> JSONResponse:
    body = await request.json()
    n = await redis.incr("bench:baseline")
    return JSONResponse({"task_id": str(n), "target": body.get("target_url")}, 202)


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_config=None, access_log=False)
