"""The Batch API's parts, built once per gateway (tokenyard/gateway/state.py): file storage, file and batch
records in Redis, and the runner. Without Redis (tests that build an app without one) there is none,
and /v1/files and /v1/batches answer 503 batch_unavailable.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tokenyard.gateway.batch.batch_runner import BatchRunner
from tokenyard.gateway.batch.batch_store import BatchStore
from tokenyard.gateway.batch.file_records import FileRecords
from tokenyard.gateway.batch.file_storage import DiskStorage, FileStorage
from tokenyard.gateway.config.batch_settings import BatchSettings

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway


REDIS_TIMEOUT_S = 5.0   # batch work is not on a request's clock: a slow Redis answer beats a line run twice


class BatchService:
    def __init__(self, gw: "Gateway", redis_url: str, prefix: str, settings: BatchSettings,
                 storage: FileStorage | None = None) -> None:
        import redis.asyncio as aioredis
        self.settings = settings
        self.storage: FileStorage = storage or DiskStorage(settings.data_dir)
        # A client of its own: the request path's client gives up after redis_timeout_ms (250 ms), and
        # a line whose answer timed out would run again (its answer is still stored once).
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                             socket_connect_timeout=REDIS_TIMEOUT_S)
        self.files = FileRecords(self.redis, prefix)
        self.batches = BatchStore(self.redis, prefix)
        self.runner = BatchRunner(gw, self.batches, self.files, self.storage, settings)

    async def start(self) -> None:
        sweep = getattr(self.storage, "sweep", None)
        if sweep is not None:
            await asyncio.to_thread(sweep)
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        await self.redis.aclose()
