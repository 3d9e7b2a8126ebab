"""S3's checks of presigned URLs, in front of moto, which makes none of them.

moto (5.2.5) authenticates only requests with an ``Authorization`` header, and only once
``INITIAL_NO_AUTH_ACTION_COUNT`` is spent (then against IAM users it holds): a presigned
request carries its signature in the query string, so moto never looks at its signature,
its ``X-Amz-Expires`` or its ``Expires``. :class:`PresignChecker` does, the way S3 does
(AWS "Authenticating Requests: Using Query Parameters", Signature Version 4), as the
``check`` of a :class:`~support.faultproxy.FaultProxy` between the clients and moto:

    checker = PresignChecker(secret_key="testing")
    with FaultProxy("127.0.0.1", moto_port, http=True, check=checker) as proxy:
        env["CKPTSTORE_S3_ENDPOINT_URL"] = proxy.url   # the service presigns for the proxy
        checker.skew_s = 3601                           # S3's clock an hour on: URLs expire

* A query-signed request (``X-Amz-Signature``) past ``X-Amz-Date + X-Amz-Expires`` by the
  checker's clock (the time plus :attr:`PresignChecker.skew_s`): ``403 AccessDenied``,
  "Request has expired" (S3's answer).
* One whose signature is not the one its secret key gives for its method, path (the bucket
  and key), query (the upload id, the part number, the expiry...) and signed headers:
  ``403 SignatureDoesNotMatch``. A URL edited to name another key is such a request.
* A Signature Version 2 query (``AWSAccessKeyId``, ``Signature``, ``Expires``): ``400
  InvalidRequest``, as S3 answers in the regions that take SigV4 only (every region opened
  since 2014). SigV2 is not checked here; the service presigns with SigV4.
* Anything else (the service's own requests, signed in an ``Authorization`` header) goes to
  moto unchecked.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import UTC, datetime
from urllib.parse import parse_qsl, quote, unquote, urlsplit

__all__ = ["PresignChecker", "s3_error"]

_SIGV4 = "AWS4-HMAC-SHA256"


def s3_error(code: str, message: str) -> bytes:
    """An S3 error document."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>presign-checker</RequestId><HostId>presign-checker</HostId></Error>"
    ).encode()


class PresignChecker:
    """``checker(head)``: None for a request S3 would serve, else ``(status line, XML)``.
    Counters: :attr:`checked` (query-signed requests seen), :attr:`expired`,
    :attr:`mismatched`."""

    def __init__(self, secret_key: str) -> None:
        self.secret_key = secret_key
        self.skew_s = 0.0  # added to this machine's clock: S3's clock, for the expiry
        self.checked = self.expired = self.mismatched = 0

    def __call__(self, head: bytes) -> tuple[str, bytes] | None:
        request_line, *lines = head.decode("latin-1").split("\r\n")
        method, target, _ = request_line.split(" ", 2)
        path, _, query = target.partition("?")
        params = parse_qsl(query, keep_blank_values=True)
        names = {name for name, _ in params}
        if "Signature" in names and "AWSAccessKeyId" in names:
            return "400 Bad Request", s3_error(
                "InvalidRequest",
                "The authorization mechanism you have provided is not supported. "
                "Please use AWS4-HMAC-SHA256.",
            )
        if "X-Amz-Signature" not in names:
            return None  # not presigned: signed in its headers, or anonymous
        self.checked += 1
        found = dict(params)
        headers = {}
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = " ".join(value.split())
        try:
            signed_at = datetime.strptime(found["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
            expires = int(found["X-Amz-Expires"])
        except (KeyError, ValueError):
            malformed = "Query-string authentication requires X-Amz-Date and X-Amz-Expires"
            return "400 Bad Request", s3_error("AuthorizationQueryParametersError", malformed)
        if time.time() + self.skew_s > signed_at.replace(tzinfo=UTC).timestamp() + expires:
            self.expired += 1
            return "403 Forbidden", s3_error("AccessDenied", "Request has expired")
        if found.get("X-Amz-Algorithm") != _SIGV4 or not hmac.compare_digest(
            found["X-Amz-Signature"], self._signature(method, path, params, headers)
        ):
            self.mismatched += 1
            return "403 Forbidden", s3_error(
                "SignatureDoesNotMatch",
                "The request signature we calculated does not match the signature you "
                "provided. Check your key and signing method.",
            )
        return None

    def _signature(
        self, method: str, path: str, params: list[tuple[str, str]], headers: dict[str, str]
    ) -> str:
        """The SigV4 signature of a query-signed request, computed afresh."""
        query = dict(params)
        day, region, service, _ = query["X-Amz-Credential"].split("/")[1:]
        signed = query["X-Amz-SignedHeaders"].split(";")
        canonical = "\n".join(
            [
                method,
                quote(unquote(urlsplit(path).path), safe="/~"),  # S3: the path encoded once
                "&".join(
                    f"{_encode(k)}={_encode(v)}"
                    for k, v in sorted(params)
                    if k != "X-Amz-Signature"
                ),
                "".join(f"{name}:{headers.get(name, '')}\n" for name in signed),
                ";".join(signed),
                "UNSIGNED-PAYLOAD",
            ]
        )
        scope = f"{day}/{region}/{service}/aws4_request"
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        to_sign = f"{_SIGV4}\n{query['X-Amz-Date']}\n{scope}\n{digest}"
        key = f"AWS4{self.secret_key}".encode()
        for part in (day, region, service, "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


def _encode(text: str) -> str:
    """SigV4's URI encoding of a query name or value: everything but A-Z a-z 0-9 - _ . ~"""
    return quote(text, safe="-_.~")
