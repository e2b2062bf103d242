"""A client of a Ray cluster's control service (GCS) with a token other than the cluster's: how the
tests check that a cluster has token authentication on."""

from __future__ import annotations

import os
import subprocess
import sys

# Prints how a call to the GCS at argv[1] ended.
_CLIENT = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", None, timeout=10)
    print("answered")
except Exception as error:
    print(type(error).__name__, error)
"""


def assert_refuses_other_tokens(gcs_address: str) -> None:
    """A process holding another token (``RAY_AUTH_TOKEN`` wins over the token file and
    ``RAY_AUTH_TOKEN_PATH``) is refused by the cluster at ``gcs_address``, in about two seconds."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
    refused = subprocess.run(
        [sys.executable, "-c", _CLIENT, gcs_address], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.stdout.startswith("AuthenticationError") and "InvalidAuthToken" in refused.stdout, (
        refused.stdout + refused.stderr[-2000:]
    )
