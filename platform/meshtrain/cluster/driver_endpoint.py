"""The job driver's Prometheus endpoint: the run's goodput as it trains and at its end, and the
downstream evaluation scores. It listens on a free port (the driver may share a node with workers on
``metrics.port + i``) and lists itself in ``<targets folder>/driver/<run>.json`` for Prometheus."""

from __future__ import annotations

from meshtrain.config import MetricsConfig
from meshtrain.observe.goodput import GoodputReport
from meshtrain.config.network import Endpoint, advertised_host
from meshtrain.observe.metrics import DriverMetrics, driver_targets_path, write_targets


class DriverEndpoint:
    def __init__(self, settings: MetricsConfig, storage_path: str, run: str) -> None:
        self.settings = settings
        self.metrics = DriverMetrics(run)
        self.targets = driver_targets_path(settings.targets_dir, storage_path, run)

    @classmethod
    def open(cls, settings: MetricsConfig, storage_path: str, run: str) -> DriverEndpoint | None:
        """None when metrics.port=0 (no Prometheus endpoints for the run)."""
        return cls(settings, storage_path, run) if settings.port else None

    def __enter__(self) -> DriverEndpoint:
        import ray

        bind = self.settings.bind_address
        port = self.metrics.serve(bind, 0)
        write_targets(self.targets, [Endpoint(advertised_host(bind, ray.util.get_node_ip_address()), port)])
        return self

    def finish(self, goodput: GoodputReport) -> None:
        """The launch's final goodput, held until Prometheus has scraped it once more."""
        self.metrics.goodput(goodput)
        self.metrics.await_final_scrape(self.settings.final_scrape_timeout_s)

    def __exit__(self, *_: object) -> None:
        write_targets(self.targets, [])  # Prometheus stops scraping the driver
        self.metrics.close()
