"""Python client of queue-gateway: submit calls, follow them, collect their results.

    from queue_gateway_client import Client
    with Client("http://127.0.0.1:8080", api_key) as qgw:
        task = qgw.submit("http://svc:9000/api/generate_image", body='{"prompt": "cat"}')
        print(task.result(timeout=60))
        qgw.submit(video_url).download("out.mp4", timeout=600)  # streamed, never in memory

`AsyncClient` is the same with `await`.
"""

from queue_gateway_client._async import AsyncClient, AsyncTask
from queue_gateway_client._common import (
    ApiError,
    GatewayUnreachable,
    QueueGatewayError,
    Status,
    TaskFailed,
    WaitTimeout,
)
from queue_gateway_client._result import Result, ResultNotRead
from queue_gateway_client._sync import Client, Task

__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncTask",
    "Client",
    "GatewayUnreachable",
    "QueueGatewayError",
    "Result",
    "ResultNotRead",
    "Status",
    "Task",
    "TaskFailed",
    "WaitTimeout",
]
__version__ = "0.1.0"
