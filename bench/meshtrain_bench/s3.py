"""A local S3 endpoint (moto's server, the project's test extra) that answers every request after a fixed
delay and counts requests and bytes served: a remote store's latency on loopback, for benchmarks."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any


class SlowS3:
    """``with SlowS3(0.05) as s3:`` serves S3 on 127.0.0.1, each request held ``delay_s`` first."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.requests = 0
        self.bytes_served = 0
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def _app(self, inner: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            time.sleep(self.delay_s)
            body = b"".join(inner(environ, start_response))
            with self._lock:
                self.requests += 1
                self.bytes_served += len(body)
            return [body]

        return app

    def __enter__(self) -> SlowS3:
        try:
            from moto.moto_server.werkzeug_app import (
                DomainDispatcherApplication,
                MotoRequestHandler,
                create_backend_app,
            )
            from werkzeug.serving import make_server
        except ImportError as exc:
            raise SystemExit(f"the S3 benchmark needs moto (pip install -e '.[test]'): {exc}") from None
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        class QuietHandler(MotoRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:  # thousands of requests: no line each
                pass

        app = self._app(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Copy every file of ``folder`` to ``s3://bucket/prefix/`` (without the delay); returns that URL."""
        import boto3

        client = boto3.client("s3", **self.storage_options["client_kwargs"])
        delay, self.delay_s = self.delay_s, 0.0
        try:
            client.create_bucket(Bucket=bucket)
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
        finally:
            self.delay_s = delay
        return f"s3://{bucket}/{prefix}"

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None) -> None:
        if self._server is not None:
            self._server.shutdown()
        if self._thread is not None:
            self._thread.join()
