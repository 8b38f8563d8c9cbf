"""`python -m dspark_operator`: run the operator (standalone: one replica, no peering CRDs)."""

from __future__ import annotations

import argparse
import os

import kopf


def main() -> None:
    parser = argparse.ArgumentParser(prog="dspark_operator", description=__doc__)
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only these namespaces (repeatable); default: DSPARK_OPERATOR_NAMESPACES "
        "(comma-separated) or all namespaces",
    )
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint")
    args = parser.parse_args()
    namespaces = args.namespace or [
        n for n in os.environ.get("DSPARK_OPERATOR_NAMESPACES", "").split(",") if n
    ]

    from dspark_operator import handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        standalone=True, clusterwide=not namespaces, namespaces=namespaces, liveness_endpoint=args.liveness
    )


if __name__ == "__main__":
    main()
