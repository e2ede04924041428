"""A real S3 endpoint on loopback (moto's threaded server) for tests of s3:// storage."""

from __future__ import annotations

import urllib.request

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def moto_s3(monkeypatch: pytest.MonkeyPatch, *buckets: str) -> Iterator[dict[str, Any]]:
    """Start the server with ``buckets`` created; yields the fsspec ``storage_options`` that reach it.

    moto accepts any credentials; they are set in the environment, so subprocesses inherit them.
    """
    import boto3
    import moto.server as server_module

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}}
        client = boto3.client("s3", **options["client_kwargs"])
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield options
    finally:
        # moto keeps its buckets in module state that outlives the server: empty it for the next test.
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"), timeout=30)
        server.stop()
