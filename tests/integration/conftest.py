"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def backends(pg_url: str, s3_endpoint: str) -> dict[str, str]:
    """Production settings for a service: a fresh PostgreSQL database and a fresh bucket on
    the moto server (``support.s3server.s3_store(env)`` opens it), keyframes every 4
    checkpoints, 256 KiB chunks."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    return {
        "CKPTSTORE_DATABASE_URL": pg_url,
        "CKPTSTORE_BLOB_URL": f"s3://{bucket}/prod",
        "CKPTSTORE_S3_ENDPOINT_URL": s3_endpoint,
        "CKPTSTORE_S3_PATH_STYLE": "true",
        "CKPTSTORE_S3_CREATE_BUCKET": "true",
        "CKPTSTORE_S3_REGION": "us-east-1",
        "CKPTSTORE_KEYFRAME_INTERVAL": "4",
        "CKPTSTORE_CHUNK_BYTES": str(256 << 10),
    }
