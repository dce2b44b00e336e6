"""The Redis clock, read in a pipeline beside the keys it is compared with.

redis-py refuses `pipe.time()` in a Cluster pipeline (it cannot tell which node to ask); the
node of a key the reading concerns answers instead, so on a Cluster too the time comes from
the master whose scripts stamp that key."""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import ClusterPipeline


def queue_time(pipe: Any, near_key: str) -> None:
    if isinstance(pipe, ClusterPipeline):
        node = pipe.cluster_client.get_node_from_key(near_key)
        pipe.execute_command("TIME", target_nodes=node)
    else:
        pipe.time()
