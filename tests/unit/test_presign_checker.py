"""The presigned-URL checker of the direct S3 tests (support.presign) does what S3 does:
takes botocore's SigV4 URLs for any key (quoted characters too) and method, and refuses
one past its expiry, one edited in its path, query or signature, one signed with another
secret, and SigV2 URLs."""

from __future__ import annotations

from urllib.parse import urlsplit

import boto3
import pytest
from botocore.config import Config

from support.presign import PresignChecker

HOST = "127.0.0.1:9000"


def presigner(signature_version: str = "s3v4", secret: str = "secret") -> object:
    session = boto3.session.Session(
        aws_access_key_id="key", aws_secret_access_key=secret, aws_session_token="token"
    )
    path = {"addressing_style": "path"}
    config = Config(region_name="us-east-1", signature_version=signature_version, s3=path)
    return session.client("s3", endpoint_url=f"http://{HOST}", config=config)


def head(method: str, url: str, **headers: str) -> bytes:
    """The request head a client sends for ``url``."""
    parts = urlsplit(url)
    lines = [f"{method} {parts.path}?{parts.query} HTTP/1.1", f"Host: {parts.netloc}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def upload_part_url(key: str, expires: int = 60, **client: str) -> str:
    params = {"Bucket": "b", "Key": key, "UploadId": "up+/=id", "PartNumber": 3}
    url: str = presigner(**client).generate_presigned_url(  # type: ignore[attr-defined]
        "upload_part", Params=params, ExpiresIn=expires
    )
    return url


@pytest.mark.parametrize(
    "key", ["prod/runs/r/3f-1-abc.presigned.blob", "a b/c~d+e=f&g", "ünï/cödé", "k//double"]
)
def test_genuine_urls_pass(key: str) -> None:
    checker = PresignChecker("secret")
    url = upload_part_url(key)
    assert checker(head("PUT", url, **{"Content-Type": "application/octet-stream"})) is None
    get: str = presigner().generate_presigned_url(  # type: ignore[attr-defined]
        "get_object", Params={"Bucket": "b", "Key": key}, ExpiresIn=60
    )
    assert checker(head("GET", get, Range="bytes=0-9")) is None  # the Range is not signed
    assert (checker.checked, checker.expired, checker.mismatched) == (2, 0, 0)


def test_an_expired_url_is_refused_as_s3_does() -> None:
    checker = PresignChecker("secret")
    url = upload_part_url("k", expires=60)
    checker.skew_s = 30
    assert checker(head("PUT", url)) is None
    checker.skew_s = 61
    status, body = checker(head("PUT", url)) or ("", b"")
    assert status == "403 Forbidden" and b"<Code>AccessDenied</Code>" in body
    assert b"Request has expired" in body and checker.expired == 1


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("/b/runs/a", "/b/runs/b"),  # another key
        ("/b/", "/c/"),  # another bucket
        ("partNumber=3", "partNumber=4"),
        ("uploadId=up%2B%2F%3Did", "uploadId=other"),
        ("X-Amz-Expires=60", "X-Amz-Expires=600"),  # a longer life
        ("X-Amz-Signature=", "X-Amz-Signature=0"),
    ],
)
def test_an_edited_url_is_refused(old: str, new: str) -> None:
    checker = PresignChecker("secret")
    url = upload_part_url("runs/a")
    assert old in url
    status, body = checker(head("PUT", url.replace(old, new, 1))) or ("", b"")
    assert status == "403 Forbidden" and b"<Code>SignatureDoesNotMatch</Code>" in body
    assert checker.mismatched == 1


def test_other_methods_and_secrets_are_refused() -> None:
    checker = PresignChecker("secret")
    url = upload_part_url("k")
    assert checker(head("GET", url)) is not None  # signed for a PUT
    assert checker(head("PUT", upload_part_url("k", secret="other"))) is not None
    assert checker(head("PUT", url.replace(HOST, "127.0.0.1:9001"))) is not None  # host signed
    assert checker.mismatched == 3


def test_sigv2_is_refused_and_unsigned_requests_pass() -> None:
    checker = PresignChecker("secret")
    status, body = checker(head("PUT", upload_part_url("k", signature_version="s3"))) or ("", b"")
    assert status == "400 Bad Request" and b"AWS4-HMAC-SHA256" in body
    assert checker(b"PUT /b/k?uploadId=1&partNumber=1 HTTP/1.1\r\nHost: h\r\n\r\n") is None
    assert checker.checked == 0
