"""/metrics: the node in Prometheus' text format (prometheus-client), gathered from the same commands the API
serves (volume.list, pool.list, workers.list) at each scrape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]


class _Once:
    """A collector of metric families made before the scrape."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


async def node_metrics(handler: Handler) -> bytes:
    volumes = await handler("volume.list", {})
    families: list[Metric] = []
    size = GaugeMetricFamily("openvsan_volume_size_bytes", "The volume's size", labels=["volume"])
    for v in volumes:
        if "size" in v:
            size.add_metric([v["name"]], v["size"])
    families.append(size)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Once(families))
    return generate_latest(registry)
