from __future__ import annotations

from collections.abc import Iterator

import pytest

from s3server import fake_aws_credentials, start_moto


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server for the session, with dummy credentials in the environment.

    Not skipped when moto is missing or will not start: the S3 backend must be tested.
    """
    with fake_aws_credentials():
        url, stop = start_moto()
        try:
            yield url
        finally:
            stop()
